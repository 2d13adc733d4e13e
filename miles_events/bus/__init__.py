"""The event framework: the bus and its mailboxes, the ``@handles`` tables, the actor API
and its host, the clock, one-line errors, the wire codec and the event log."""
