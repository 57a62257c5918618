"""Worker role flags and lease/retry numbers of the runtime process.

They are read once, with every other setting, by ``services.config.load_config`` (the
``FLOW_RUNTIME_*`` variables of the README's configuration table) and handed here as
:class:`WorkerSettings` by :meth:`WorkerSettings.from_config`; nothing in the runtime
reads the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime_svc.kernel import RetryPolicy
from services.config import ServiceConfig

__all__ = ["WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    """Role flags and timings of the in-process workers and sweeps.

    Attributes:
        workers: worker tasks in this process (``FLOW_RUNTIME_WORKERS``, 0 = off).
        sweeps: run recovery, cancellation and retention sweeps here.
        lease_ms: claim/heartbeat lease.
        retry_base_ms / retry_max_ms: exponential retry backoff base and cap.
        max_attempts: attempts per step.
        idle_ms: longest idle backoff of a worker with no work.
        sweep_ms: sweep interval.
        batch_size: candidates per ``eligible_work`` call.
        org_batch: orgs one worker/sweep pass serves (the rotation resumes after them).
        view_file: test/dev only: one ``MetadataViewInput`` JSON for every scope.
        retention_days: terminal runs older than this are purged (lineage only).
        request_retention_hours: request-dedupe rows older than this are purged.
        wait_sweep_ms: period of the wake reconciler and the wait expiry/repair sweeps.
        wait_batch: rows one wait sweep handles per org.
        signal_kinds: external signal producer kinds ``SubmitWakeSignal`` accepts.
        legacy_scheduler: run the LegacyInterpreter scheduler here (§20 due list and
            stale-claim recovery; ``FLOW_RUNTIME_LEGACY_SCHEDULER``).
        reauth_cache_ms: principal-directory cache of step reauthorization (§17.2;
            ``FLOW_RUNTIME_REAUTH_CACHE_MS``).
        preclaim_wake: a wait resolution in this process claims the resumed step for
            these workers in its own transaction (``docs/adr/0007``;
            ``FLOW_RUNTIME_PRECLAIM_WAKE``).
    """

    workers: int = 1
    sweeps: bool = True
    lease_ms: int = 60_000
    retry_base_ms: int = 1_000
    retry_max_ms: int = 300_000
    max_attempts: int = 5
    idle_ms: int = 500
    sweep_ms: int = 1_000
    batch_size: int = 20
    org_batch: int = 100
    view_file: str | None = None
    retention_days: int = 30
    request_retention_hours: int = 168
    wait_sweep_ms: int = 1_000
    wait_batch: int = 100
    signal_kinds: tuple[str, ...] = ("external.signal",)
    legacy_scheduler: bool = True
    reauth_cache_ms: int = 5_000
    preclaim_wake: bool = True

    @classmethod
    def from_config(cls, cfg: ServiceConfig) -> WorkerSettings:
        """The settings ``cfg`` selects (validated by ``load_config``)."""
        return cls(
            workers=cfg.runtime_workers,
            sweeps=cfg.runtime_sweeps,
            lease_ms=cfg.runtime_lease_ms,
            retry_base_ms=cfg.runtime_retry_base_ms,
            retry_max_ms=cfg.runtime_retry_max_ms,
            max_attempts=cfg.runtime_max_attempts,
            idle_ms=cfg.runtime_idle_ms,
            sweep_ms=cfg.runtime_sweep_ms,
            view_file=cfg.runtime_view_file,
            retention_days=cfg.runtime_retention_days,
            request_retention_hours=cfg.request_retention_hours,
            wait_sweep_ms=cfg.runtime_wait_sweep_ms,
            wait_batch=cfg.runtime_wait_batch,
            signal_kinds=cfg.runtime_signal_kinds,
            legacy_scheduler=cfg.runtime_legacy_scheduler,
            reauth_cache_ms=cfg.runtime_reauth_cache_ms,
            preclaim_wake=cfg.runtime_preclaim_wake,
        )

    def retry_policy(self) -> RetryPolicy:
        """The kernel retry/lease policy these settings select."""
        return RetryPolicy(
            max_attempts=self.max_attempts,
            base_delay_ms=self.retry_base_ms,
            max_delay_ms=self.retry_max_ms,
            lease_duration_ms=self.lease_ms,
        )
