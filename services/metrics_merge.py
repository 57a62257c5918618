"""One ``/metrics`` for a process and the worker processes it supervises.

With ``FLOW_RUNTIME_WORKER_PROCESSES`` the steps execute in child processes
(``runtime_svc.processes``), so the claim, step, transaction and outbox events of §19 are
counted there. Prometheus scrapes one port per pod, so the supervising process's endpoint
exposes its own registry **merged** with its children's: at scrape time it reads each
child's endpoint (an ephemeral loopback port) and adds the child's samples to the family
of the same name, labelled ``worker_process="<slot>"`` (a family appears once in the
exposition — two ``# TYPE`` lines for one name would fail the scrape). ``sum by (…)``
over the usual labels therefore counts the whole pod, as before.

A child that does not answer within the timeout is left out of that scrape (its counters
reappear with the next one; a restarted child starts from zero, which ``rate()`` reads as a
counter reset). ``*_created`` samples of children are dropped: the text format exposes them
as separate gauge families that would collide with the parent's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

__all__ = ["CHILD_LABEL", "ChildSource", "MergedRegistry"]

log = logging.getLogger(__name__)

#: The label that tells a child's series from the parent's and from each other.
CHILD_LABEL = "worker_process"

#: Yields ``(slot, exposition text)`` for every child that answered.
ChildSource = Callable[[], Iterable[tuple[str, str]]]


class MergedRegistry(CollectorRegistry):
    """``base``'s metrics with the families of every child of ``sources`` merged in
    (see the module docstring). ``sources`` is read at each scrape, so children can
    come and go after the endpoint started."""

    def __init__(self, base: CollectorRegistry, sources: list[ChildSource]) -> None:
        super().__init__(auto_describe=False)
        self._base, self._sources = base, sources

    def register(self, collector: Collector) -> None:
        self._base.register(collector)

    def collect(self) -> Iterable[Any]:
        merged = {family.name: family for family in self._base.collect()}
        for source in list(self._sources):
            try:
                children = list(source())
            except Exception:  # a scrape must never fail because a child misbehaved
                log.exception("reading the worker processes' metrics failed")
                continue
            for slot, text in children:
                try:
                    families = list(text_string_to_metric_families(text))
                except ValueError:
                    log.warning("worker process %s exposed unparsable metrics", slot)
                    continue
                for family in families:
                    if family.name.endswith("_created"):
                        continue
                    samples = [
                        Sample(s.name, {**s.labels, CHILD_LABEL: slot}, s.value, s.timestamp)
                        for s in family.samples
                        if not s.name.endswith("_created")
                    ]
                    mine = merged.get(family.name)
                    if mine is None:
                        family.samples = samples
                        merged[family.name] = family
                    elif mine.type == family.type:
                        mine.samples.extend(samples)
        return list(merged.values())
