"""The ``flow.effect.submit`` message of the canonical Runtime outbox: computed before
the EffectSubmit transaction, enqueued last inside it (spec §10.7, §15.1).

The runtime-side EffectSubmit step uses exactly two calls::

    intent = effect_submit_intent(scope, flow_run_id=…, submit_step_key=…,
                                  invocation_ordinal=…, step_execution_id=…,
                                  submission_attempt_id=…, effect_owner_kind=…,
                                  payload={…}, deadline=…, failure_policy="fault_path")
    # §15.1 step 1: pure, no lock — the EffectHandoffKey, the Runtime outbox identity,
    # the frozen canonical payload and its digest are all deterministic.
    ...
    async with transaction(engine) as conn:
        # lock root → submit and completion steps → submit attempt → dependency …
        await enqueue_effect_submit_txn(conn, intent, now=now)   # last: INSERT on the
        # unique (scope, family, key); a retry of the same submit finds its own row
        # write the immutable FlowEffectLink (intent.handoff_key, intent.message_id) …

``enqueue_effect_submit_txn`` never locks anything before its insert and never calls a
root mutator; a different message under the same key (a bug) raises ``ConflictError``
and rolls the whole step back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.outbox.table import RUNTIME_OUTBOX
from services.db_batch import Write
from services.digest import canonical_json
from services.effect_contract import (
    FLOW_EFFECT_SUBMIT_FAMILY,
    EffectContractError,
    WorkScopeLike,
    effect_handoff_key,
    effect_payload_digest,
    runtime_outbox_message_id,
)
from services.outbox import EnqueueResult, NewOutboxMessage, PreClaim, enqueue_txn

__all__ = [
    "FAILURE_POLICIES",
    "PAYLOAD_SCHEMA_VERSION",
    "EffectSubmitIntent",
    "effect_submit_intent",
    "enqueue_effect_submit_txn",
]

#: Version of the owner-acceptance payload schema this runtime writes.
PAYLOAD_SCHEMA_VERSION = 1
#: ``runtime_outbox.failure_policy`` codes (the dependency's compiled ``ExpiryPolicy``).
FAILURE_POLICIES = frozenset({"fault_path", "terminal_failure", "quarantine"})


@dataclass(frozen=True)
class EffectSubmitIntent:
    """Everything the EffectSubmit transaction writes into the outbox, precomputed."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    handoff_key: str
    message_id: str
    effect_owner_kind: str
    payload_json: str
    payload_digest: str
    flow_run_id: str
    step_execution_id: str
    submission_attempt_id: str
    deadline: datetime | None
    failure_policy: str

    def message(self) -> NewOutboxMessage:
        """The generic outbox message of this intent."""
        return NewOutboxMessage(
            org_id=self.org_id,
            app_installation_id=self.app_installation_id,
            runtime_capability_id=self.runtime_capability_id,
            runtime_work_binding_digest=self.runtime_work_binding_digest,
            message_id=self.message_id,
            family=FLOW_EFFECT_SUBMIT_FAMILY,
            key=self.handoff_key,
            payload=self.payload_json,
            payload_digest=self.payload_digest,
            extra={
                "effect_owner_kind": self.effect_owner_kind,
                "payload_schema_version": PAYLOAD_SCHEMA_VERSION,
                "flow_run_id": self.flow_run_id,
                "step_execution_id": self.step_execution_id,
                "submission_attempt_id": self.submission_attempt_id,
                "deadline": self.deadline,
                "failure_policy": self.failure_policy,
            },
        )


def effect_submit_intent(
    scope: WorkScopeLike,
    *,
    flow_run_id: str,
    submit_step_key: str,
    invocation_ordinal: int,
    step_execution_id: str,
    submission_attempt_id: str,
    effect_owner_kind: str,
    payload: Mapping[str, Any],
    deadline: datetime | None,
    failure_policy: str,
) -> EffectSubmitIntent:
    """Compute the deterministic intent of one EffectSubmit invocation (pure).

    Raises:
        EffectContractError: a malformed component, a payload without canonical form or
            an unknown failure policy.
    """
    if failure_policy not in FAILURE_POLICIES:
        raise EffectContractError(f"failure_policy must be one of {sorted(FAILURE_POLICIES)}")
    if not effect_owner_kind or not step_execution_id or not submission_attempt_id:
        raise EffectContractError("owner kind, step execution and attempt are required")
    if deadline is not None and deadline.utcoffset() is None:
        raise EffectContractError("deadline must be an aware datetime")
    key = effect_handoff_key(
        scope,
        flow_run_id=flow_run_id,
        submit_step_key=submit_step_key,
        invocation_ordinal=invocation_ordinal,
    )
    digest = effect_payload_digest(payload)
    return EffectSubmitIntent(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
        handoff_key=key,
        message_id=runtime_outbox_message_id(key),
        effect_owner_kind=effect_owner_kind,
        payload_json=canonical_json(dict(payload)).decode("utf-8"),
        payload_digest=digest,
        flow_run_id=flow_run_id,
        step_execution_id=step_execution_id,
        submission_attempt_id=submission_attempt_id,
        deadline=deadline,
        failure_policy=failure_policy,
    )


async def enqueue_effect_submit_txn(
    conn: AsyncConnection,
    intent: EffectSubmitIntent,
    *,
    now: datetime | None = None,
    preclaim: PreClaim | None = None,
    before: Sequence[Write] = (),
) -> EnqueueResult:
    """Enqueue ``intent`` into the canonical Runtime outbox — last, inside the caller's
    EffectSubmit transaction (see the module docstring); with ``preclaim`` already leased
    to this process's dispatcher (ADR 0004: ``EnqueueResult.leased`` is handed to it
    after the commit). ``before``: the transaction's writes that go first, in the same
    round trip (``services.outbox.enqueue_after``).

    Raises:
        ConflictError: the key already holds a different message; or whatever a write of
            ``before`` raises.
    """
    return await enqueue_txn(
        conn,
        RUNTIME_OUTBOX,
        intent.message(),
        now=now,
        preclaim=preclaim,
        before=before,
    )
