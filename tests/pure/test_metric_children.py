"""`fleet.metrics.children_kept`: a family's `labels(...)` from a dict of the children it made (the
hot path labels ~8 series a call). The same series whatever form a value takes (an `Outcome` or
its word), counted as prometheus_client counts it, keyword labels still served."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from fleet.metrics import children_kept
from fleet.outcome import Outcome


def test_one_child_a_series_counted_as_prometheus_counts() -> None:
    registry = CollectorRegistry()
    family = Counter("t_calls", "calls", ["tier", "outcome"], registry=registry)
    children_kept(family)
    a = family.labels("routing", Outcome.COMPLETED)
    assert family.labels("routing", "completed") is a  # an Outcome is its word: one series
    a.inc()
    family.labels("routing", "completed").inc(2)
    family.labels(tier="routing", outcome="expired").inc()  # by name: made as prometheus makes it
    text = generate_latest(registry).decode()
    assert 't_calls_total{outcome="completed",tier="routing"} 3.0' in text
    assert 't_calls_total{outcome="expired",tier="routing"} 1.0' in text
