"""Flow-run service layer (§10.1, §18, §19): ``StartRun`` resolution and input
validation, reads with the compatibility projection, keyset listing, the support read,
authorized delete and cancellation, and after-save trigger admission.

Pure modules: :mod:`.inputs`, :mod:`.keys`, :mod:`.tokens`. Storage reads: :mod:`.resolve`
(``ListRuns`` reads through the kernel's ``list_runs_txn``). Composition: :mod:`.service`,
:mod:`.after_save`.
Writes happen only through :class:`runtime_svc.kernel.FlowRunStateStore`. The gRPC
servicer lives in ``runtime_svc.api.runs``.
"""

from __future__ import annotations

from runtime_svc.runs.after_save import (
    AFTER_SAVE,
    admit_after_save_runs_txn,
    select_after_save_plans,
)
from runtime_svc.runs.inputs import DeclaredVariable, validate_input_variables
from runtime_svc.runs.keys import after_save_key, caller_key, start_key
from runtime_svc.runs.resolve import FlowTarget, ResolvedPlan
from runtime_svc.runs.service import (
    CANCEL_ROLE,
    DELETE_ROLE,
    RunService,
    RunSupport,
    RunView,
    StartOutcome,
)
from runtime_svc.runs.tokens import PageCursor, PageTokenCodec

__all__ = [
    "AFTER_SAVE",
    "CANCEL_ROLE",
    "DELETE_ROLE",
    "DeclaredVariable",
    "FlowTarget",
    "PageCursor",
    "PageTokenCodec",
    "ResolvedPlan",
    "RunService",
    "RunSupport",
    "RunView",
    "StartOutcome",
    "admit_after_save_runs_txn",
    "after_save_key",
    "caller_key",
    "select_after_save_plans",
    "start_key",
    "validate_input_variables",
]
