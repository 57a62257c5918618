"""Per-field definition of "a handler broadens its owner's declared capability"."""

from __future__ import annotations

from typing import Any

import pytest

from catalog_svc.domain import DiagnosticCode, broadened_fields
from tests.unit.catalog.factories import descriptor


def _paths(declared: dict[str, Any], asserted: dict[str, Any], *, effect: bool) -> list[str]:
    d = descriptor(declared, effect=effect)
    a = descriptor({**declared, **asserted}, effect=effect)
    found = broadened_fields(d, a)
    assert all(x.code is DiagnosticCode.CAPABILITY_BROADENED for x in found)
    return [x.path for x in found]


def test_identical_capability_does_not_broaden() -> None:
    assert broadened_fields(descriptor(), descriptor()) == []
    assert broadened_fields(descriptor(effect=False), descriptor(effect=False)) == []


# (declared changes, asserted changes, effect base?, broadened path or None when narrower)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], bool, str | None]] = [
    ("exec: read under mutation", {}, {"execution_class": "record_read"}, False, None),
    (
        "exec: mutation under read",
        {"execution_class": "record_read"},
        {"execution_class": "record_mutation"},
        False,
        "execution_class",
    ),
    ("txn: caller under profile", {}, {"transaction_policy": "caller_transaction"}, False, None),
    (
        "txn: profile under owned",
        {"transaction_policy": "owned_transaction"},
        {"transaction_policy": "profile_dependent"},
        False,
        "transaction_policy",
    ),
    (
        "txn: owned under caller",
        {"transaction_policy": "caller_transaction"},
        {"transaction_policy": "owned_transaction"},
        False,
        "transaction_policy",
    ),
    (
        "replay: deterministic under idempotent",
        {"replay_policy": "at_most_once"},
        {"replay_policy": "deterministic_replay"},
        False,
        None,
    ),
    (
        "replay: not replayable under at-most-once",
        {"replay_policy": "at_most_once"},
        {"replay_policy": "not_replayable"},
        False,
        "replay_policy",
    ),
    ("fanout: 5 under 10", {}, {"fanout_bound.static_maximum": 5}, False, None),
    ("fanout: 11 over 10", {}, {"fanout_bound.static_maximum": 11}, False, "fanout_bound"),
    (
        "fanout: unknown over static",
        {},
        {"fanout_bound": {"kind": "unknown"}},
        False,
        "fanout_bound",
    ),
    (
        "fanout: other metadata path",
        {},
        {"fanout_bound.metadata_path": "input.bcc"},
        True,
        "fanout_bound",
    ),
    (
        "fanout: anything under unknown",
        {"fanout_bound": {"kind": "unknown"}},
        {"fanout_bound": {"kind": "static_maximum", "static_maximum": 1}},
        True,
        None,
    ),
    ("read: checkpoint under current", {}, {"read_contract": "checkpoint_only"}, False, None),
    (
        "read: snapshot vs current",
        {},
        {"read_contract": "verified_snapshot"},
        False,
        "read_contract",
    ),
    (
        "lock: fewer static keys",
        {},
        {
            "lock_plan_contract.static_keys": [
                {
                    "resource_class": "record",
                    "namespace": "Account",
                    "record_identity": "$trigger.Id",
                    "ordering_version": 1,
                }
            ]
        },
        False,
        None,
    ),
    (
        "lock: late discovery over static",
        {},
        {
            "lock_plan_contract": {
                "kind": "late_discovery_allowed",
                "resource_classes": ["record"],
                "max_keys": 4,
            }
        },
        False,
        "lock_plan_contract.kind",
    ),
    (
        "lock: extra static key",
        {},
        {
            "lock_plan_contract.static_keys": [
                {"resource_class": "record", "namespace": "Contact", "ordering_version": 1}
            ],
            "lock_plan_contract.resource_classes": ["record"],
        },
        False,
        "lock_plan_contract.static_keys",
    ),
    (
        "lock: extra class",
        {
            "lock_plan_contract": {
                "kind": "metadata_derived_keys",
                "resource_classes": ["record"],
                "max_keys": 4,
            }
        },
        {"lock_plan_contract.resource_classes": ["record", "history_sequence"]},
        False,
        "lock_plan_contract.resource_classes",
    ),
    (
        "lock: more keys",
        {},
        {"lock_plan_contract.max_keys": 5},
        False,
        "lock_plan_contract.max_keys",
    ),
    (
        "effect owner differs",
        {},
        {"effect_owner.effect_owner_kind": "email.ses"},
        True,
        "effect_owner",
    ),
    (
        "idempotency: other key shape",
        {},
        {"idempotency_policy.key_shape": "${input.invoice_id}"},
        True,
        "idempotency_policy.key_shape",
    ),
    ("idempotency: wider scope", {}, {"idempotency_policy.uniqueness_scope": "org"}, True, None),
    (
        "idempotency: narrower scope",
        {},
        {
            "idempotency_policy.uniqueness_scope": "flow_run",
            "idempotency_policy.key_shape": "invoice:${input.invoice_id}:${step.invocation}",
        },
        True,
        "idempotency_policy.uniqueness_scope",
    ),
    ("durability: receipt kept", {}, {}, True, None),
    (
        "durability: ephemeral under checkpointed",
        {},
        {"output_durability": "ephemeral"},
        False,
        "output_durability",
    ),
    (
        "principal: system over initiating",
        {},
        {"security_policy.principal_mode": "system"},
        True,
        "security_policy.principal_mode",
    ),
    (
        "principal: caller under initiating",
        {},
        {"security_policy.principal_mode": "caller"},
        False,
        None,
    ),
    (
        "reauth: handoff over fault path",
        {},
        {"security_policy.reauthorization_policy": "system_handoff"},
        False,
        "security_policy.reauthorization_policy",
    ),
    (
        "reauth: terminal under fault path",
        {},
        {"security_policy.reauthorization_policy": "terminal_failure"},
        False,
        None,
    ),
    (
        "version: newer requirement",
        {},
        {"minimum_capability_version": 3},
        False,
        "minimum_capability_version",
    ),
    ("version: older requirement", {}, {"minimum_capability_version": 1}, False, None),
]


@pytest.mark.parametrize(
    ("declared", "asserted", "effect", "path"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_field_broadening_rule(
    declared: dict[str, Any], asserted: dict[str, Any], effect: bool, path: str | None
) -> None:
    assert _paths(declared, asserted, effect=effect) == ([] if path is None else [path])
