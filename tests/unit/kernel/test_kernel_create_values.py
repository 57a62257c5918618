"""Run creation's hand-written field copies equal ``dataclasses.asdict`` (the request
digest and the root's scope columns must not drift if a field is added)."""

from __future__ import annotations

import dataclasses

from runtime_svc.kernel import CheckpointInput, FirstStep, StartRunRequest
from runtime_svc.kernel.store_create import _flat_values, _scope_values
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest

SCOPE = TrustedRuntimeWorkScope("org-a", "inst-a", "cap-a", "binding-a")
FIRST = FirstStep("create", "bounded_mutation", "bounded_atomic_foreground", 2)


def test_the_scope_and_first_step_copies_equal_asdict() -> None:
    assert _scope_values(SCOPE) == dataclasses.asdict(SCOPE)
    assert _flat_values(FIRST) == dataclasses.asdict(FIRST)


def test_the_request_digest_is_the_one_asdict_gave() -> None:
    request = StartRunRequest(
        "plan-1", FIRST, CheckpointInput(context={"variables": {"x": 1}}, plan_cursor={})
    )
    expected = versioned_digest(
        "start-run-request",
        {
            "scope": dataclasses.asdict(SCOPE),
            "plan_id": "plan-1",
            "first_step": dataclasses.asdict(FIRST),
            "context": request.input.context,
            "plan_cursor": request.input.plan_cursor,
            "context_schema_version": request.input.context_schema_version,
            "priority": 0,
            "admit": True,
        },
    )
    assert request.digest(SCOPE) == expected
