"""The public surfaces of the record engine are pinned (STYLE 13)."""

from __future__ import annotations

import runtime_svc.api.records as api_records
import runtime_svc.records as records
import runtime_svc.resources as resources


def test_record_engine_exports() -> None:
    assert sorted(records.__all__) == [
        "Actor",
        "DEFAULT_MAX_REPLANS",
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
    for name in records.__all__:
        assert hasattr(records, name), name


def test_resources_exports() -> None:
    assert sorted(resources.__all__) == [
        "LateResourceDiscoveryError",
        "LockPlan",
        "LockRole",
        "ORDERING_VERSION",
        "ResourceClass",
        "ResourceKey",
        "business_key",
        "canonical_order",
        "history_key",
        "is_canonical",
        "plan_record_mutation",
    ]


def test_record_api_exports() -> None:
    assert sorted(api_records.__all__) == [
        "CatalogRecordViews",
        "RecordServicer",
        "RecordViewSource",
        "SERVICE_NAME",
        "build_record_service",
        "record_proto",
        "record_view_from_proto",
    ]
