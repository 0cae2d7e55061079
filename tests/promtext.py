"""Reading ``/metrics`` in tests with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: ``(name, sorted labels) -> value``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def types(text: str) -> dict[str, str]:
    """Each family's type, by family name (a counter's without ``_total``)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}
