"""Bus subscribers that observe a run: the event log, the metrics exporter, the console and
the tracking sinks."""
