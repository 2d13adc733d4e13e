"""The actors, one a file: Coordinator, Generator, Trainer, Publisher, Verifier, Saver; the
Generator's engines and the Trainer's backends; and the Coordinator's protocols (state
machines, not actors)."""
