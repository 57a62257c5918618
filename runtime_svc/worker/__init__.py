"""Durable Orchestration worker: step executor, claim/execute/commit loop, sweeps and the
process-lifecycle hook :func:`start_background` (issue 5, deliverable 3; spec §12)."""

from __future__ import annotations

from runtime_svc.worker.background import Background, IdleBackoff, start_background
from runtime_svc.worker.executor import (
    RESOURCE_BOUND_EXCEEDED,
    RUN_OUTPUT_KEY,
    MutationIntent,
    ResourceBoundExceeded,
    StepFault,
    StepOutcome,
    apply_intents_txn,
    check_resource_bounds,
    interpret,
    needs_transaction,
)
from runtime_svc.worker.loop import Outcome, PhaseHook, StepWorker, Sweeper, orgs_with_work
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.snapshots import SNAPSHOT_CHANGED, ReadToken, SnapshotChangedError
from runtime_svc.worker.views import FixedViews, RecordViewSource

__all__ = [
    "RESOURCE_BOUND_EXCEEDED",
    "RUN_OUTPUT_KEY",
    "SNAPSHOT_CHANGED",
    "Background",
    "FixedViews",
    "IdleBackoff",
    "MutationIntent",
    "Outcome",
    "PhaseHook",
    "ReadToken",
    "RecordViewSource",
    "ResourceBoundExceeded",
    "SnapshotChangedError",
    "StepFault",
    "StepOutcome",
    "StepWorker",
    "Sweeper",
    "WorkerSettings",
    "apply_intents_txn",
    "check_resource_bounds",
    "interpret",
    "needs_transaction",
    "orgs_with_work",
    "start_background",
]
