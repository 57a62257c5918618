"""Embedded Before-Save (§9.1): a record-triggered transform that runs inside the record
engine's own transaction, before the row is written — no Flow root, no second
transaction, no pause. See :mod:`runtime_svc.embedded.dispatch`."""

from __future__ import annotations

from runtime_svc.embedded.dispatch import (
    BEFORE_SAVE,
    BEFORE_SAVE_FAILED_ACTION,
    ActivationRead,
    BeforeSaveDispatcher,
    BeforeSaveEvidence,
    BeforeSaveFailedError,
    record_failure,
)
from runtime_svc.embedded.transform import BeforeSaveFault, TransformOutcome, run_before_save

__all__ = [
    "BEFORE_SAVE",
    "BEFORE_SAVE_FAILED_ACTION",
    "ActivationRead",
    "BeforeSaveDispatcher",
    "BeforeSaveEvidence",
    "BeforeSaveFailedError",
    "BeforeSaveFault",
    "TransformOutcome",
    "record_failure",
    "run_before_save",
]
