"""The actors, one a file: Coordinator, Generator, Trainer, Publisher, Verifier, Saver; and the
Generator's engines and the Trainer's backends."""
