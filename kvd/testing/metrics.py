"""A daemon's ``/metrics``, read the way Prometheus reads it: one parser for
tests, the bench and the real-engine drivers."""

from __future__ import annotations

import urllib.request
from typing import Any


def samples(metrics_url: str, timeout: float = 10) -> list[Any]:
    """Every sample on ``metrics_url`` (prometheus_client's ``Sample``: name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=timeout).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(metrics_url: str, name: str, timeout: float = 5, **labels: str) -> float:
    """The sum of sample ``name``'s values over the label sets that carry
    ``labels`` (all of them by default)."""
    return sum(s.value for s in samples(metrics_url, timeout) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def histogram_sums(metrics_url: str, family: str, label: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of histogram ``family`` per value of ``label`` (its
    samples without the label under ``""``)."""
    out: dict[str, tuple[float, float]] = {}
    for s in samples(metrics_url):
        if s.name not in (f"{family}_sum", f"{family}_count"):
            continue
        key = s.labels.get(label, "")
        total, count = out.get(key, (0.0, 0.0))
        out[key] = (total + s.value, count) if s.name.endswith("_sum") else (total, count + s.value)
    return out
