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
supervising process; a dead child is restarted by the pool, not by Kubernetes).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from services.background import DEFAULT_GRACE_S
from services.config import ServiceConfig
from services.process_pool import ProcessPool

__all__ = ["CHILD_OVERRIDES", "child_argv", "child_env", "start_worker_processes"]

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


async def start_worker_processes(
    cfg: ServiceConfig, parent_env: Mapping[str, str]
) -> ProcessPool | None:
    """Start ``cfg.runtime_worker_processes`` supervised worker processes (None when 0).

    A child is given the gRPC drain grace plus the background loops' grace to finish
    its in-flight steps after SIGTERM before it is killed.
    """
    n = cfg.runtime_worker_processes
    if n <= 0:
        return None
    pool = ProcessPool(
        "runtime worker process",
        child_argv(),
        child_env(parent_env),
        n,
        stop_grace_s=cfg.shutdown_grace_s + DEFAULT_GRACE_S + 10.0,
    )
    return await pool.start()
