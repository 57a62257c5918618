"""Scraping and reading a ``/metrics`` endpoint in tests (the Prometheus text format,
parsed with prometheus-client's own parser), and the §19 metric list the tests check."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "SECTION_19",
    "Scrape",
    "metrics_port_from_log",
    "scrape",
    "scrape_sync",
]

#: Every §19 "Required metrics" bullet and the metric families that carry it.
SECTION_19: Mapping[str, tuple[str, ...]] = {
    "accepted, runnable, waiting, terminal, and quarantined run counts": ("nexus_flow_runs",),
    "queue age and oldest age by lane": (
        "nexus_flow_queue_age_seconds",
        "nexus_flow_queue_oldest_age_seconds",
        "nexus_flow_queue_depth",
    ),
    "claims, claim conflicts, lease expiries, and stale-fence rollbacks": (
        "nexus_flow_claims",
        "nexus_flow_claim_conflicts",
        "nexus_flow_lease_expiries",
        "nexus_flow_stale_fence_rollbacks",
    ),
    "step duration and transaction duration by plan step": (
        "nexus_flow_step_duration_seconds",
        "nexus_flow_step_transaction_duration_seconds",
    ),
    "lock wait, deadlock, rollback, and ambiguity rates": (
        "nexus_flow_lock_wait_seconds",
        "nexus_flow_db_lock_wait_timeouts",
        "nexus_flow_db_deadlocks",
        "nexus_flow_db_transactions",
    ),
    "retry count and retry-budget exhaustion": (
        "nexus_flow_step_retries",
        "nexus_flow_retry_budget_exhausted",
    ),
    "checkpoint size and serialization failures": (
        "nexus_flow_checkpoint_size_bytes",
        "nexus_flow_checkpoint_serialization_failures",
    ),
    "dependency age, wake latency, and missing-producer count": (
        "nexus_flow_dependency_age_seconds",
        "nexus_flow_dependency_oldest_age_seconds",
        "nexus_flow_wake_latency_seconds",
        "nexus_flow_dependency_missing_producers",
    ),
    "effect-submit and effect-completion latency": (
        "nexus_flow_effect_submit_latency_seconds",
        "nexus_flow_effect_completion_latency_seconds",
    ),
    "compatibility-projection divergence": ("nexus_flow_projection_divergent_runs",),
    "old/new scheduler ownership conflicts, which must remain zero": (
        "nexus_flow_dual_ownership_runs",
    ),
}


@dataclass(frozen=True)
class Scrape:
    """One parsed scrape: families by name, samples by sample name."""

    families: Mapping[str, str]  # family name -> type
    samples: Mapping[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(
            v
            for got, v in self.samples.get(name, [])
            if all(got.get(k) == want for k, want in labels.items())
        )

    def has(self, family: str) -> bool:
        return family in self.families


def _parse(body: str) -> Scrape:
    families: dict[str, str] = {}
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body):
        families[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Scrape(families, samples)


def scrape_sync(port: int, host: str = "127.0.0.1") -> Scrape:
    """GET ``/metrics`` and parse it (bounded by a timeout)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return _parse(response.read().decode("utf-8"))


async def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    """:func:`scrape_sync` off the event loop."""
    return await asyncio.to_thread(scrape_sync, port, host)


_PORT_RE = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def metrics_port_from_log(path: Path) -> int | None:
    """The port a process logged for ``FLOW_METRICS_PORT=0`` (None until it did)."""
    if not path.exists():
        return None
    found = _PORT_RE.findall(path.read_text(encoding="utf-8", errors="replace"))
    return int(found[-1]) if found else None
