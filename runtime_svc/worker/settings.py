"""Worker role flags and lease/retry numbers, read from the environment.

Temporary home: these belong in ``services.config.ServiceConfig`` (the lead moves them);
until then :meth:`WorkerSettings.from_env` is the one place that reads them.

=================================  =========  ==============================================
variable                           default    meaning
=================================  =========  ==============================================
``FLOW_RUNTIME_WORKERS``           ``1``      worker tasks in this process (0 = off)
``FLOW_RUNTIME_SWEEPS``            ``true``   run recovery/cancellation sweeps here
``FLOW_RUNTIME_LEASE_MS``          ``60000``  claim/heartbeat lease
``FLOW_RUNTIME_RETRY_BASE_MS``     ``1000``   exponential backoff base
``FLOW_RUNTIME_RETRY_MAX_MS``      ``300000`` backoff cap
``FLOW_RUNTIME_MAX_ATTEMPTS``      ``5``      attempts per step
``FLOW_RUNTIME_IDLE_MS``           ``500``    max idle backoff of a worker with no work
``FLOW_RUNTIME_SWEEP_MS``          ``1000``   sweep interval
``FLOW_RUNTIME_RETENTION_DAYS``    ``30``     terminal runs older than this are purged
                                              (lineage rows only; records/audit stay)
``FLOW_RUNTIME_VIEW_FILE``         (none)     test/dev only: a MetadataViewInput JSON used
                                              as every scope's record view
``FLOW_RUNTIME_LEGACY_SCHEDULER``  ``true``   run the LegacyInterpreter scheduler here (due
                                              list, stale-claim recovery; §20.8 drain)
=================================  =========  ==============================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from runtime_svc.kernel import RetryPolicy

__all__ = ["WorkerSettings"]


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {raw!r}")


@dataclass(frozen=True)
class WorkerSettings:
    """Role flags and timings of the in-process workers and sweeps."""

    workers: int = 1
    sweeps: bool = True
    lease_ms: int = 60_000
    retry_base_ms: int = 1_000
    retry_max_ms: int = 300_000
    max_attempts: int = 5
    idle_ms: int = 500
    sweep_ms: int = 1_000
    batch_size: int = 20
    view_file: str | None = None
    retention_days: int = 30
    legacy_scheduler: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """Read the ``FLOW_RUNTIME_*`` variables (see the module docstring).

        Raises:
            ValueError: a malformed value.
        """
        e = os.environ if env is None else env
        base = _int(e, "FLOW_RUNTIME_RETRY_BASE_MS", 1_000, 1)
        return cls(
            workers=_int(e, "FLOW_RUNTIME_WORKERS", 1, 0),
            sweeps=_bool(e, "FLOW_RUNTIME_SWEEPS", True),
            lease_ms=_int(e, "FLOW_RUNTIME_LEASE_MS", 60_000, 1),
            retry_base_ms=base,
            retry_max_ms=_int(e, "FLOW_RUNTIME_RETRY_MAX_MS", max(300_000, base), base),
            max_attempts=_int(e, "FLOW_RUNTIME_MAX_ATTEMPTS", 5, 1),
            idle_ms=_int(e, "FLOW_RUNTIME_IDLE_MS", 500, 1),
            sweep_ms=_int(e, "FLOW_RUNTIME_SWEEP_MS", 1_000, 1),
            view_file=e.get("FLOW_RUNTIME_VIEW_FILE") or None,
            retention_days=_int(e, "FLOW_RUNTIME_RETENTION_DAYS", 30, 1),
            legacy_scheduler=_bool(e, "FLOW_RUNTIME_LEGACY_SCHEDULER", True),
        )

    def retry_policy(self) -> RetryPolicy:
        """The kernel retry/lease policy these settings select."""
        return RetryPolicy(
            max_attempts=self.max_attempts,
            base_delay_ms=self.retry_base_ms,
            max_delay_ms=self.retry_max_ms,
            lease_duration_ms=self.lease_ms,
        )
