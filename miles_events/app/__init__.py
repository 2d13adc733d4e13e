"""The application: the only part of ``miles_events`` that imports ``actors``. Config loading,
the run plan, the session, replay and redrive, and the generated reference docs."""
