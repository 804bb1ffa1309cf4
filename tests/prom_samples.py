"""Read a `/metrics` exposition the way Prometheus does (label order is the library's business)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample `name` whose labels include `labels`; None if there is none."""
    found = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) <= 1, f"{name}{labels}: {len(found)} samples"
    return float(found[0]) if found else None
