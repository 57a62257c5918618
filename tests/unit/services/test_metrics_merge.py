"""``services.metrics_merge``: the supervisor's ``/metrics`` merges its worker processes'
families into its own — one ``# TYPE`` per name, child series labelled by slot."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics_merge import CHILD_LABEL, ChildSource, MergedRegistry


def _registry(claims: float) -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("nexus_flow_claims", "Step claims won.", ["lane"], registry=r).labels("d").inc(claims)
    Histogram("nexus_flow_step_seconds", "Step time.", registry=r).observe(0.2)
    return r


def _type_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("# TYPE")]


def test_children_are_merged_into_the_parents_families_with_their_slot() -> None:
    children = {
        "0": generate_latest(_registry(3)).decode(),
        "1": generate_latest(_registry(4)).decode(),
    }
    sources: list[ChildSource] = [lambda: children.items()]
    text = generate_latest(MergedRegistry(_registry(1), sources)).decode()
    types = _type_lines(text)
    assert len(types) == len(set(types))  # every family once: the scrape stays valid
    claims = {
        s.labels.get(CHILD_LABEL, "parent"): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "nexus_flow_claims"
        for s in f.samples
        if s.name == "nexus_flow_claims_total"
    }
    assert claims == {"parent": 1.0, "0": 3.0, "1": 4.0}
    steps = [
        s
        for f in text_string_to_metric_families(text)
        if f.name == "nexus_flow_step_seconds"
        for s in f.samples
        if s.name == "nexus_flow_step_seconds_count"
    ]
    assert sorted(s.labels.get(CHILD_LABEL, "parent") for s in steps) == ["0", "1", "parent"]


def test_a_failing_or_garbled_child_never_fails_the_scrape() -> None:
    def broken() -> Iterable[tuple[str, str]]:
        raise OSError("child gone")

    garbled: ChildSource = lambda: [("0", "nexus_flow_claims_total{lane= 1\n")]  # noqa: E731
    text = generate_latest(MergedRegistry(_registry(2), [broken, garbled])).decode()
    assert 'nexus_flow_claims_total{lane="d"} 2.0' in text
    assert CHILD_LABEL not in text


def test_sources_added_after_the_endpoint_started_are_read_at_the_next_scrape() -> None:
    sources: list[ChildSource] = []
    merged = MergedRegistry(_registry(1), sources)
    assert CHILD_LABEL not in generate_latest(merged).decode()
    sources.append(lambda: [("2", generate_latest(_registry(5)).decode())])
    assert f'{CHILD_LABEL}="2"' in generate_latest(merged).decode()
