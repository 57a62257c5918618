"""The record engine that Flows and ordinary writes mutate (issue 5, deliverable 1).

Business records per object of the bound metadata view, with field validation, optimistic
``version``, per-record history-sequence reservation, and a business event plus an audit
record written in the same transaction; locks in the §13.1 order of
:mod:`runtime_svc.resources`. See :mod:`runtime_svc.records.engine`.
"""

from __future__ import annotations

from runtime_svc.records.engine import (
    DEFAULT_MAX_REPLANS,
    EngineStats,
    HeldLocks,
    LockHook,
    RecordEngine,
    StaleVersionError,
    acquire_locks_txn,
    apply_mutation_txn,
    get_record_txn,
    plan_mutation,
)
from runtime_svc.records.model import (
    Actor,
    Lineage,
    MutationKind,
    MutationResult,
    ParentRef,
    RecordMutation,
    RecordState,
    RequestRef,
    new_record_id,
)
from runtime_svc.records.validation import (
    RecordValidationError,
    prepare_create,
    prepare_delete,
    prepare_transformed,
    prepare_update,
)
from runtime_svc.records.view import FieldRules, FieldType, ObjectRules, RecordView

__all__ = [
    "DEFAULT_MAX_REPLANS",
    "Actor",
    "EngineStats",
    "FieldRules",
    "FieldType",
    "HeldLocks",
    "Lineage",
    "LockHook",
    "MutationKind",
    "MutationResult",
    "ObjectRules",
    "ParentRef",
    "RecordEngine",
    "RecordMutation",
    "RecordState",
    "RecordValidationError",
    "RecordView",
    "RequestRef",
    "StaleVersionError",
    "acquire_locks_txn",
    "apply_mutation_txn",
    "get_record_txn",
    "new_record_id",
    "plan_mutation",
    "prepare_create",
    "prepare_delete",
    "prepare_transformed",
    "prepare_update",
]
