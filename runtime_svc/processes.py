"""``FLOW_RUNTIME_WORKER_PROCESSES``: the runtime's step workers in their own processes.

A Python process uses one core at most; the worker's per-step CPU is what limits durable
throughput on a multi-core host, so the runtime process (``serve``, or ``worker`` in a
worker-only pod) can start and supervise N copies of ``python -m runtime_svc worker
--supervised`` (:class:`services.process_pool.ProcessPool`) against the same database.
The supervising process then runs no step workers itself.

Which duty runs where (the split is fixed here, not configured per child):

* **per worker process** (they scale with execution): the ``FLOW_RUNTIME_WORKERS`` step
  workers (effect steps included), the canonical-outbox dispatcher
  (``FLOW_OUTBOX_DISPATCHERS``: an EffectSubmit a worker commits wakes the dispatcher of
  its own process at once) and the writer-fleet registration/heartbeat (§20.3: every
  process that writes is a registered writer);
* **once, in the supervising process** (periodic duties whose work does not grow with
  the number of processes; several copies would only repeat each other's scans): the
  recovery/cancellation, wait, effect and retention sweeps (``FLOW_RUNTIME_SWEEPS``), the
  legacy scheduler (``FLOW_RUNTIME_LEGACY_SCHEDULER``), schema migration, ``/metrics``
  and the authoritative-state scan. Every one of them is fenced, so running them in
  several replicas stays correct; keeping them out of the children keeps N cheap.

Children bind their health server to an ephemeral loopback port (probes target the
supervising process; a dead child is restarted by the pool, not by Kubernetes). When the
supervisor serves ``/metrics`` (``FLOW_METRICS_PORT``), each child serves its own on a
fresh loopback port and the supervisor's endpoint merges them in, labelled
``worker_process`` (``services.metrics_merge``): one scrape per pod sees every step.
"""

from __future__ import annotations

import logging
import socket
import sys
import urllib.request
from collections.abc import Iterable, Mapping

from services.background import DEFAULT_GRACE_S
from services.config import ServiceConfig
from services.metrics import metrics
from services.process_pool import ProcessPool

__all__ = [
    "CHILD_OVERRIDES",
    "child_argv",
    "child_env",
    "child_metrics",
    "start_worker_processes",
]

log = logging.getLogger(__name__)

#: How long one scrape of the supervisor waits for each child's ``/metrics``.
_CHILD_SCRAPE_TIMEOUT_S = 2.0

#: What a supervised worker process runs differently from its supervisor (see the
#: module docstring): no grand-children, no sweeps or legacy scheduler, no migration,
#: no metrics endpoint or state scan, health on an ephemeral loopback port.
CHILD_OVERRIDES: Mapping[str, str] = {
    "FLOW_RUNTIME_WORKER_PROCESSES": "0",
    "FLOW_RUNTIME_SWEEPS": "false",
    "FLOW_RUNTIME_LEGACY_SCHEDULER": "false",
    "FLOW_DB_AUTO_MIGRATE": "false",
    "FLOW_METRICS_PORT": "",
    "FLOW_METRICS_STATE_MS": "0",
    "FLOW_RUNTIME_PORT": "0",
    "FLOW_LISTEN_HOST": "127.0.0.1",
}


def child_argv() -> list[str]:
    """The command line of one supervised worker process."""
    return [sys.executable, "-m", "runtime_svc", "worker", "--supervised"]


def child_env(parent: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker process: the supervisor's (same database, keys,
    timings, ``FLOW_RUNTIME_WORKERS``) with :data:`CHILD_OVERRIDES` applied."""
    env = dict(parent)
    env.update(CHILD_OVERRIDES)
    return env


def _loopback_port() -> int:
    """A port free on 127.0.0.1 now (a child that loses it to a race exits and is
    restarted with another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metrics_port(slot: int) -> Mapping[str, str]:
    del slot
    return {"FLOW_METRICS_PORT": str(_loopback_port())}


def child_metrics(pool: ProcessPool) -> Iterable[tuple[str, str]]:
    """``(slot, exposition text)`` of every live child of ``pool`` that answers (read by
    the supervisor's ``/metrics`` at scrape time, in the endpoint's own thread)."""
    for slot, pid, extra in pool.children():
        port = extra.get("FLOW_METRICS_PORT")
        if not port:
            continue
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=_CHILD_SCRAPE_TIMEOUT_S) as resp:
                text = resp.read().decode("utf-8")
        except OSError as exc:
            log.debug("worker process %d (pid %d) metrics unavailable: %s", slot, pid, exc)
            continue
        yield str(slot), text


async def start_worker_processes(
    cfg: ServiceConfig, parent_env: Mapping[str, str]
) -> ProcessPool | None:
    """Start ``cfg.runtime_worker_processes`` supervised worker processes (None when 0).

    A child is given the gRPC drain grace plus the background loops' grace to finish
    its in-flight steps after SIGTERM before it is killed. With a metrics endpoint here,
    each child serves its own on a fresh loopback port, merged into this one.
    """
    n = cfg.runtime_worker_processes
    if n <= 0:
        return None
    merge = cfg.telemetry.metrics_port is not None
    pool = ProcessPool(
        "runtime worker process",
        child_argv(),
        child_env(parent_env),
        n,
        stop_grace_s=cfg.shutdown_grace_s + DEFAULT_GRACE_S + 10.0,
        spawn_env=_metrics_port if merge else None,
    )
    await pool.start()
    if merge:
        metrics().child_sources.append(lambda: child_metrics(pool))
    return pool
