"""Pure values and decisions of the Flow side of an external effect (§15.1, §15.2).

* :func:`submit_identities` — every identity an ``EffectSubmit`` writes, computed before
  its transaction from the deterministic ``EffectHandoffKey`` (§15.1 step 1): the
  Runtime outbox message, the ``EffectCompletion`` step, its dependency and the
  ``FlowEffectLink``. A retried, recovered or re-claimed submit of the same invocation
  computes the same ones, so it can only ever find its own rows.
* :func:`effect_payload` — the frozen, safe owner-acceptance payload: the plan step's
  action inputs evaluated on the checkpoint, canonical JSON, bounded, credential-free.
* :func:`validate_receipt` — the ``EffectCompletion`` step's check of the consumed
  receipt against the link: handoff key, owner kind, outcome version, wake token,
  evidence digest (§15.2).
* :func:`route_completion` — where a validated receipt sends the run: success, the
  compiled fault path, terminal failure, or quarantine (``OUTCOME_UNKNOWN`` follows the
  dependency's declared policy, §15.3).

No I/O; no SQLAlchemy; no protos.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from runtime_svc.kernel.checkpoint_guard import find_credential_material
from runtime_svc.kernel.wait_model import ExpiryPolicyCode
from services.digest import CanonicalJsonError, canonical_json, versioned_digest
from services.effect_contract import (
    CompletionEvidence,
    CompletionOutcomeCode,
    EffectContractError,
    WorkScopeLike,
    completion_wake_token,
    effect_handoff_key,
    runtime_outbox_message_id,
    wake_evidence_digest,
)

__all__ = [
    "MAX_EFFECT_PAYLOAD_BYTES",
    "CompletionRoute",
    "ConsumedReceipt",
    "LinkRecord",
    "PayloadError",
    "ReceiptInvalid",
    "Route",
    "SubmitIdentities",
    "effect_payload",
    "route_completion",
    "submit_identities",
    "validate_receipt",
]

#: Bound of one owner-acceptance payload (canonical JSON bytes).
MAX_EFFECT_PAYLOAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class SubmitIdentities:
    """The identities of one ``EffectSubmit`` invocation (all deterministic)."""

    handoff_key: str
    message_id: str
    completion_step_id: str
    dependency_id: str
    link_id: str


def _derived(prefix: str, kind: str, handoff_key: str) -> str:
    return f"{prefix}_" + versioned_digest(kind, handoff_key).rsplit(":", 1)[1][:32]


def submit_identities(
    scope: WorkScopeLike, *, flow_run_id: str, submit_step_key: str, invocation_ordinal: int
) -> SubmitIdentities:
    """The identities of one ``EffectSubmit`` invocation (§15.1 step 1).

    Raises:
        EffectContractError: an empty component or a negative ordinal.
    """
    key = effect_handoff_key(
        scope,
        flow_run_id=flow_run_id,
        submit_step_key=submit_step_key,
        invocation_ordinal=invocation_ordinal,
    )
    return SubmitIdentities(
        handoff_key=key,
        message_id=runtime_outbox_message_id(key),
        completion_step_id=_derived("step", "effect-completion-step", key),
        dependency_id=_derived("dep", "effect-completion-dependency", key),
        link_id=_derived("lnk", "effect-link", key),
    )


class PayloadError(ValueError):
    """The evaluated inputs cannot be an owner-acceptance payload; ``code`` is safe."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def effect_payload(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The frozen owner-acceptance payload of evaluated action inputs.

    Raises:
        PayloadError: ``effect_payload_invalid`` (no canonical JSON form),
            ``effect_payload_credential`` (credential material — the message names the
            path, never the value) or ``effect_payload_too_large``.
    """
    payload = {str(k): v for k, v in inputs.items()}
    try:
        encoded = canonical_json(payload)
    except CanonicalJsonError as exc:
        raise PayloadError("effect_payload_invalid", f"no canonical JSON form: {exc}") from None
    found = find_credential_material(payload)
    if found:
        raise PayloadError(
            "effect_payload_credential",
            f"credential material at {found[0].path} ({found[0].rule}) cannot leave the runtime",
        )
    if len(encoded) > MAX_EFFECT_PAYLOAD_BYTES:
        raise PayloadError(
            "effect_payload_too_large",
            f"{len(encoded)} bytes exceed the {MAX_EFFECT_PAYLOAD_BYTES}-byte payload bound",
        )
    return payload


@dataclass(frozen=True)
class LinkRecord:
    """One ``flow_effect_links`` row (§10.8), decoded: immutable lineage."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    effect_link_id: str
    flow_run_id: str
    step_execution_id: str
    effect_owner_kind: str
    runtime_outbox_message_id: str
    effect_handoff_key: str
    submission_attempt_id: str
    created_at: datetime | None = None


class ReceiptInvalid(ValueError):
    """A consumed receipt or its link does not validate; ``code`` is safe."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ConsumedReceipt:
    """What the completion step read: the consumed signal's identity and evidence."""

    producer_kind: str
    producer_key: str
    wake_token: str
    wake_version: int | None
    evidence_digest: str
    evidence_json: str | None
    dependency_wake_version: int | None


def validate_receipt(
    receipt: ConsumedReceipt,
    link: LinkRecord | None,
    *,
    producer_kind: str,
    handoff_key: str,
    owner_kind: str,
    flow_run_id: str,
) -> CompletionEvidence:
    """Check the consumed completion receipt and the immutable link (§15.2).

    Raises:
        ReceiptInvalid: any disagreement — never a guess.
    """
    if link is None:
        raise ReceiptInvalid("effect_link_missing", "no effect link for the handoff key")
    checks = [
        (link.effect_handoff_key != handoff_key, "link_key", "the link names another key"),
        (link.flow_run_id != flow_run_id, "link_run", "the link belongs to another run"),
        (link.effect_owner_kind != owner_kind, "link_owner", "the link names another owner"),
        (
            link.runtime_outbox_message_id != runtime_outbox_message_id(handoff_key),
            "link_message",
            "the link names another outbox message",
        ),
        (receipt.producer_kind != producer_kind, "receipt_kind", "not a completion receipt"),
        (receipt.producer_key != handoff_key, "receipt_key", "the receipt names another key"),
    ]
    for failed, code, message in checks:
        if failed:
            raise ReceiptInvalid(f"effect_{code}_mismatch", message)
    if not receipt.evidence_json:
        raise ReceiptInvalid("effect_receipt_evidence_missing", "the receipt has no evidence")
    try:
        evidence = CompletionEvidence.from_json(receipt.evidence_json)
        digest = wake_evidence_digest(receipt.evidence_json)
        token = completion_wake_token(evidence.command_id, evidence.outcome_version)
    except EffectContractError as exc:
        raise ReceiptInvalid("effect_receipt_malformed", str(exc)) from None
    checks = [
        (evidence.effect_handoff_key != handoff_key, "evidence_key", "evidence names another key"),
        (
            evidence.effect_owner_kind != owner_kind,
            "evidence_owner",
            "evidence names another owner",
        ),
        (digest != receipt.evidence_digest, "evidence_digest", "evidence digest differs"),
        (token != receipt.wake_token, "wake_token", "wake token differs from the evidence"),
        (
            receipt.wake_version != evidence.outcome_version
            or receipt.dependency_wake_version not in (None, evidence.outcome_version),
            "outcome_version",
            "outcome version differs between evidence, signal and dependency",
        ),
    ]
    for failed, code, message in checks:
        if failed:
            raise ReceiptInvalid(f"effect_{code}_mismatch", message)
    return evidence


class Route(StrEnum):
    """Where an ``EffectCompletion`` sends the run."""

    SUCCESS = "success"
    FAULT_PATH = "fault_path"
    TERMINAL_FAILURE = "terminal_failure"
    QUARANTINE = "quarantine"


@dataclass(frozen=True)
class CompletionRoute:
    """A routing decision and the safe code it records."""

    route: Route
    code: str = ""


def route_completion(
    outcome: CompletionOutcomeCode, policy: ExpiryPolicyCode, *, has_fault_path: bool
) -> CompletionRoute:
    """Route a validated receipt (§15.2, §15.3).

    ``SUCCEEDED`` follows the success edge. ``FAILED`` follows the compiled fault
    connector when the element has one, else ends the run failed (``effect_failed``).
    ``OUTCOME_UNKNOWN`` is never success and never retried: it follows the declared
    policy — the explicit fault path when the element declares one, otherwise quarantine.
    """
    if outcome is CompletionOutcomeCode.SUCCEEDED:
        return CompletionRoute(Route.SUCCESS)
    if outcome is CompletionOutcomeCode.FAILED:
        if has_fault_path:
            return CompletionRoute(Route.FAULT_PATH, "effect_failed")
        return CompletionRoute(Route.TERMINAL_FAILURE, "effect_failed")
    if policy is ExpiryPolicyCode.FAULT_PATH and has_fault_path:
        return CompletionRoute(Route.FAULT_PATH, "effect_outcome_unknown")
    return CompletionRoute(Route.QUARANTINE, "effect_outcome_unknown")
