"""miles-events: an RL post-training orchestrator as an actor system on one typed event bus.

Layers, each importing only those before it: ``schemas`` <- ``miles_events`` (``bus``,
``runtime``, ``transport``, ``rl``, ``sinks``) <- ``actors`` <- ``miles_events.app``.
Entry points: ``python -m miles_events.run`` and ``python -m miles_events.replay``.
"""
