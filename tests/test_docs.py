"""docs/ stays true: the references are generated from the schemas."""

from miles_events.app.reference_docs import generated


def test_config_and_events_references_are_current():
    stale = [str(path) for path, text in generated().items() if not path.exists() or path.read_text() != text]
    assert not stale, f"run: python -m miles_events.app.reference_docs (stale: {stale})"
