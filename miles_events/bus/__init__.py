"""The event framework: the bus and its mailboxes, the actor API and its host, the wire
codec and the event log."""
