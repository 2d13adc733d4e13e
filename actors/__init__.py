"""The actors: Generator, Trainer, Publisher, Verifier, Saver, and their backends."""
