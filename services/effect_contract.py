"""The cross-service effect contract, defined once so the runtime and the effect owner
compute byte-identical keys, digests and evidence (spec §10.7, §15).

Pure: no I/O, no generated protos, no SQLAlchemy. Everything here is deterministic.

**EffectHandoffKey grammar** (version 1)::

    EffectHandoffKey := "ehk1" ":" ScopePart ":" LineagePart          (134 characters)
    ScopePart        := hex(SHA-256("nexus.flow/effect-handoff-scope/v1\\n"
                            + canonical_json([org_id, app_installation_id,
                                              runtime_capability_id,
                                              runtime_work_binding_digest])))
    LineagePart      := hex(SHA-256("nexus.flow/effect-handoff-lineage/v1\\n"
                            + canonical_json([flow_run_id, submit_step_key,
                                              invocation_ordinal])))

``ScopePart`` canonically encodes the complete trusted Runtime work scope (§10.7): an
owner verifies that a key was minted for the caller's trusted scope by recomputing it
(:func:`handoff_key_matches_scope`) — a key minted for any other org, installation,
capability or binding digest does not match. ``LineagePart`` makes the key deterministic
for one EffectSubmit invocation: the run, the submit step's plan step key and its
invocation ordinal (a loop revisiting the step is a new invocation and a new effect), so a
retried, recovered or replayed submit computes the same key and the owner inbox collapses
it to one command. Hashes, not literal values, keep the key inside ``KEY_LEN`` (200)
whatever the identifier lengths; ``canonical_json`` of a list removes any separator
ambiguity.

**Derived identities** (all deterministic from the key, computed before any transaction,
§15.1 step 1): :func:`runtime_outbox_message_id` (the canonical Runtime outbox row of the
``flow.effect.submit`` message) and :func:`provider_idempotency_key` (what the owner's
provider sends as ``Message-ID`` / ``Idempotency-Key``; one per command, the same on
every remote attempt, so a replay collapses at a provider that deduplicates).

**Payload digest**: :func:`effect_payload_digest` over the frozen safe payload (a JSON
object); the envelope carries it and the owner recomputes it from ``payload_json``.

**Completion receipts → wake signals** (the contract the runtime's ``WakeSignalService``
receiving side implements)::

    producer_kind   = "effect.completion"
    producer_key    = the EffectHandoffKey
    wake_token      = "<command_id>/<outcome_version>"
    wake_version    = outcome_version
    evidence_json   = canonical JSON of {"command_id", "outcome_version", "outcome",
                      "safe_error_code", "result_digest", "effect_owner_kind",
                      "effect_handoff_key"}  (at most 16 KiB)
    evidence_digest = wake_evidence_digest(evidence_json)
                    = versioned_digest("wake-evidence", json.loads(evidence_json))

``outcome`` is ``SUCCEEDED``, ``FAILED`` or ``OUTCOME_UNKNOWN``; ``safe_error_code`` and
``result_digest`` are ``""`` when absent. :class:`CompletionEvidence` builds and parses it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from services.auth.trust import HANDOFF_SUBMIT_ROLE as _HANDOFF_SUBMIT_ROLE
from services.auth.trust import SIGNALS_SUBMIT_ROLE
from services.digest import CanonicalJsonError, canonical_json, versioned_digest

__all__ = [
    "EFFECT_COMPLETION_FAMILY",
    "EFFECT_COMPLETION_PRODUCER_KIND",
    "FLOW_EFFECT_SUBMIT_FAMILY",
    "FLOW_EFFECT_SUBMIT_FAMILY_VERSION",
    "HANDOFF_KEY_PREFIX",
    "HANDOFF_SUBMIT_ROLE",
    "MAX_EVIDENCE_BYTES",
    "WAKE_SIGNAL_SUBMIT_ROLE",
    "CompletionEvidence",
    "CompletionOutcomeCode",
    "EffectContractError",
    "HandoffKeyParts",
    "WorkScopeLike",
    "completion_wake_token",
    "effect_handoff_key",
    "effect_payload_digest",
    "handoff_key_matches_scope",
    "handoff_scope_part",
    "parse_effect_handoff_key",
    "parse_wake_token",
    "provider_idempotency_key",
    "runtime_outbox_message_id",
    "wake_evidence_digest",
]

#: Message family of the Runtime outbox effect handoff (§10.7) and its schema version.
FLOW_EFFECT_SUBMIT_FAMILY = "flow.effect.submit"
FLOW_EFFECT_SUBMIT_FAMILY_VERSION = 1
#: Message family of the owner's producer outbox carrying completion receipts (§15.2).
EFFECT_COMPLETION_FAMILY = "effect.completion.receipt"
#: ``producer_kind`` of completion-receipt wake signals.
EFFECT_COMPLETION_PRODUCER_KIND = "effect.completion"
#: Role the runtime's credential carries to call ``AcceptHandoff``/``RejectIfUnaccepted``
#: and the role a producer's credential carries to call ``SubmitWakeSignal`` (both
#: defined with the other roles in ``services.auth``).
HANDOFF_SUBMIT_ROLE = _HANDOFF_SUBMIT_ROLE
WAKE_SIGNAL_SUBMIT_ROLE = SIGNALS_SUBMIT_ROLE
#: Upper bound of ``evidence_json`` (UTF-8 bytes).
MAX_EVIDENCE_BYTES = 16 * 1024

HANDOFF_KEY_PREFIX = "ehk1"
_HEX64 = r"[0-9a-f]{64}"
_KEY_RE = re.compile(rf"^{HANDOFF_KEY_PREFIX}:(?P<scope>{_HEX64}):(?P<lineage>{_HEX64})$")
_OWNER_KIND_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
_COMMAND_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class EffectContractError(ValueError):
    """A value does not follow the effect contract (malformed key, evidence, token)."""


class WorkScopeLike(Protocol):
    """Anything carrying the four trusted work-scope components (``services.auth``'s
    ``TrustedRuntimeWorkScope``, an outbox row, a proto)."""

    @property
    def org_id(self) -> str: ...

    @property
    def app_installation_id(self) -> str: ...

    @property
    def runtime_capability_id(self) -> str: ...

    @property
    def runtime_work_binding_digest(self) -> str: ...


def _hex(kind: str, value: Any) -> str:
    return versioned_digest(kind, value).rsplit(":", 1)[1]


def _scope_values(scope: WorkScopeLike) -> list[str]:
    values = [
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    ]
    if not all(isinstance(v, str) and v for v in values):
        raise EffectContractError("every work-scope component must be a non-empty string")
    return values


def handoff_scope_part(scope: WorkScopeLike) -> str:
    """``ScopePart`` of the handoff-key grammar for ``scope`` (64 hex characters)."""
    return _hex("effect-handoff-scope", _scope_values(scope))


def effect_handoff_key(
    scope: WorkScopeLike, *, flow_run_id: str, submit_step_key: str, invocation_ordinal: int
) -> str:
    """The deterministic ``EffectHandoffKey`` of one EffectSubmit invocation.

    Args:
        scope: the run's complete trusted Runtime work scope.
        flow_run_id: the run.
        submit_step_key: the plan step key of the ``EffectSubmit`` step.
        invocation_ordinal: the step invocation's ordinal (0 for the first).

    Raises:
        EffectContractError: an empty component or a negative ordinal.
    """
    if not flow_run_id or not submit_step_key:
        raise EffectContractError("flow_run_id and submit_step_key must not be empty")
    if isinstance(invocation_ordinal, bool) or invocation_ordinal < 0:
        raise EffectContractError("invocation_ordinal must be a non-negative integer")
    lineage = _hex("effect-handoff-lineage", [flow_run_id, submit_step_key, invocation_ordinal])
    return f"{HANDOFF_KEY_PREFIX}:{handoff_scope_part(scope)}:{lineage}"


@dataclass(frozen=True)
class HandoffKeyParts:
    """A parsed ``EffectHandoffKey``."""

    scope_part: str
    lineage_part: str


def parse_effect_handoff_key(key: str) -> HandoffKeyParts:
    """Split a key into its grammar parts.

    Raises:
        EffectContractError: the key does not follow the grammar.
    """
    m = _KEY_RE.match(key or "")
    if m is None:
        raise EffectContractError("effect_handoff_key does not follow the ehk1 grammar")
    return HandoffKeyParts(m.group("scope"), m.group("lineage"))


def handoff_key_matches_scope(key: str, scope: WorkScopeLike) -> bool:
    """True when ``key`` is well formed and was minted for exactly ``scope``."""
    try:
        parts = parse_effect_handoff_key(key)
    except EffectContractError:
        return False
    return parts.scope_part == handoff_scope_part(scope)


def runtime_outbox_message_id(handoff_key: str, family: str = FLOW_EFFECT_SUBMIT_FAMILY) -> str:
    """The deterministic canonical Runtime outbox identity of a handoff (36 characters)."""
    parse_effect_handoff_key(handoff_key)
    return "rob_" + _hex("runtime-outbox-message", [family, handoff_key])[:32]


def provider_idempotency_key(effect_owner_kind: str, handoff_key: str) -> str:
    """The provider idempotency key of the one command accepted for ``handoff_key``.

    The same on every remote attempt of the command (never per attempt), so a replay
    after a crash or an ambiguous response collapses at a deduplicating provider.
    """
    if not _OWNER_KIND_RE.match(effect_owner_kind or ""):
        raise EffectContractError("effect_owner_kind is malformed")
    parse_effect_handoff_key(handoff_key)
    return "nfx-" + _hex("provider-idempotency", [effect_owner_kind, handoff_key])[:48]


def effect_payload_digest(payload: Mapping[str, Any]) -> str:
    """``PayloadDigest`` of a frozen safe effect payload (a JSON object)."""
    if not isinstance(payload, Mapping):
        raise EffectContractError("an effect payload must be a JSON object")
    try:
        return versioned_digest("effect-payload", payload)
    except CanonicalJsonError as exc:
        raise EffectContractError(f"effect payload has no canonical form: {exc}") from None


# --- completion receipts as wake signals --------------------------------------------------


class CompletionOutcomeCode(StrEnum):
    """Business outcome a completion receipt publishes (``effect.v1.CompletionOutcome``)."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"


def completion_wake_token(command_id: str, outcome_version: int) -> str:
    """``wake_token`` of a completion receipt: ``"<command_id>/<outcome_version>"``."""
    if not _COMMAND_ID_RE.match(command_id or ""):
        raise EffectContractError("command_id is malformed")
    if isinstance(outcome_version, bool) or outcome_version < 1:
        raise EffectContractError("outcome_version must be >= 1")
    return f"{command_id}/{outcome_version}"


def parse_wake_token(token: str) -> tuple[str, int]:
    """``(command_id, outcome_version)`` of a completion wake token.

    Raises:
        EffectContractError: the token is malformed.
    """
    command_id, sep, version = (token or "").rpartition("/")
    if not sep or not version.isdigit() or not _COMMAND_ID_RE.match(command_id):
        raise EffectContractError("wake_token is not <command_id>/<outcome_version>")
    value = int(version)
    if value < 1 or str(value) != version:
        raise EffectContractError("wake_token outcome version is malformed")
    return command_id, value


def wake_evidence_digest(evidence_json: str) -> str:
    """The canonical digest of an ``evidence_json`` document (``wake-evidence/v1``).

    Raises:
        EffectContractError: not a JSON object with a canonical form.
    """
    try:
        doc = json.loads(evidence_json)
    except ValueError:
        raise EffectContractError("evidence_json is not JSON") from None
    if not isinstance(doc, dict):
        raise EffectContractError("evidence_json must be a JSON object")
    try:
        return versioned_digest("wake-evidence", doc)
    except CanonicalJsonError as exc:
        raise EffectContractError(f"evidence_json has no canonical form: {exc}") from None


_EVIDENCE_FIELDS = (
    "command_id",
    "outcome_version",
    "outcome",
    "safe_error_code",
    "result_digest",
    "effect_owner_kind",
    "effect_handoff_key",
)


@dataclass(frozen=True)
class CompletionEvidence:
    """The safe evidence of one completion receipt (see the module docstring).

    Raises:
        EffectContractError: on construction, when a field breaks the contract.
    """

    command_id: str
    outcome_version: int
    outcome: CompletionOutcomeCode
    effect_owner_kind: str
    effect_handoff_key: str
    safe_error_code: str = ""
    result_digest: str = ""

    def __post_init__(self) -> None:
        completion_wake_token(self.command_id, self.outcome_version)
        if not isinstance(self.outcome, CompletionOutcomeCode):
            raise EffectContractError("outcome must be a CompletionOutcomeCode")
        if not _OWNER_KIND_RE.match(self.effect_owner_kind or ""):
            raise EffectContractError("effect_owner_kind is malformed")
        parse_effect_handoff_key(self.effect_handoff_key)
        if len(self.safe_error_code) > 64 or len(self.result_digest) > 100:
            raise EffectContractError("safe_error_code or result_digest is too long")
        if self.outcome is CompletionOutcomeCode.SUCCEEDED and self.safe_error_code:
            raise EffectContractError("a SUCCEEDED receipt carries no safe_error_code")

    @property
    def wake_token(self) -> str:
        return completion_wake_token(self.command_id, self.outcome_version)

    def to_doc(self) -> dict[str, Any]:
        return {
            "command_id": self.command_id,
            "outcome_version": self.outcome_version,
            "outcome": self.outcome.value,
            "safe_error_code": self.safe_error_code,
            "result_digest": self.result_digest,
            "effect_owner_kind": self.effect_owner_kind,
            "effect_handoff_key": self.effect_handoff_key,
        }

    def to_json(self) -> str:
        """Canonical ``evidence_json``."""
        return canonical_json(self.to_doc()).decode("utf-8")

    def digest(self) -> str:
        """``evidence_digest`` of :meth:`to_json`."""
        return versioned_digest("wake-evidence", self.to_doc())

    @classmethod
    def from_json(cls, evidence_json: str) -> CompletionEvidence:
        """Parse and validate ``evidence_json`` (exact field set, bounded size).

        Raises:
            EffectContractError: anything that breaks the contract.
        """
        if len(evidence_json.encode("utf-8")) > MAX_EVIDENCE_BYTES:
            raise EffectContractError("evidence_json exceeds 16 KiB")
        try:
            doc = json.loads(evidence_json)
        except ValueError:
            raise EffectContractError("evidence_json is not JSON") from None
        if not isinstance(doc, dict) or set(doc) != set(_EVIDENCE_FIELDS):
            raise EffectContractError("evidence_json must hold exactly the contract fields")
        version = doc["outcome_version"]
        strings = [doc[f] for f in _EVIDENCE_FIELDS if f != "outcome_version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise EffectContractError("outcome_version must be an integer")
        if not all(isinstance(s, str) for s in strings):
            raise EffectContractError("evidence fields must be strings")
        try:
            outcome = CompletionOutcomeCode(doc["outcome"])
        except ValueError:
            raise EffectContractError("outcome is not a completion outcome") from None
        return cls(
            command_id=doc["command_id"],
            outcome_version=version,
            outcome=outcome,
            effect_owner_kind=doc["effect_owner_kind"],
            effect_handoff_key=doc["effect_handoff_key"],
            safe_error_code=doc["safe_error_code"],
            result_digest=doc["result_digest"],
        )
