"""Validation of a producer notification before anything is written (§10.6, §14.1).

A :class:`SignalSubmission` is what ``SubmitWakeSignal`` (or ``flowctl signal send``)
carries; :func:`validate_submission` checks it against the producer registry and returns
the :class:`~runtime_svc.kernel.wait_model.NewSignal` to insert, or raises
:class:`~services.errors.InvalidArgumentError` naming the field — so a bad request writes
nothing.

**Evidence** is optional, safe producer evidence: one JSON object, at most 16 KiB in its
canonical form (sorted keys, no insignificant whitespace; ``services.digest``), with no
credential material (the checkpoint rules, §17.3). It is stored canonically and
immutably; when present, ``evidence_digest`` must equal
:func:`evidence_digest` of it — ``wake-evidence/v1:sha256:<hex>``. An event wait's
condition reads it as ``$Event``.

**Effect completions** (``effect.completion``) are the effect owner's receipts: the
producer key is the ``EffectHandoffKey``, the token ``<command_id>/<outcome_version>``,
the wake version the outcome version (>= 1), and the evidence carries
:data:`EFFECT_EVIDENCE_FIELDS` with ``outcome`` one of :data:`EFFECT_OUTCOMES`; every one
of those must agree with the envelope. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.kernel.checkpoint_guard import find_credential_material
from runtime_svc.kernel.wait_model import NewSignal
from runtime_svc.waits.registry import ProducerFamily, ProducerRegistry
from services.db import KEY_LEN, TOKEN_LEN
from services.digest import CanonicalJsonError, canonical_json, is_digest, versioned_digest
from services.errors import InvalidArgumentError
from services.invariants import InvariantError

__all__ = [
    "EFFECT_EVIDENCE_FIELDS",
    "EFFECT_OUTCOMES",
    "EVIDENCE_DIGEST_KIND",
    "MAX_EVIDENCE_BYTES",
    "MAX_PRODUCER_KEY_CHARS",
    "MAX_WAKE_TOKEN_CHARS",
    "MAX_WAKE_VERSION",
    "SignalSubmission",
    "evidence_digest",
    "parse_evidence",
    "validate_submission",
]

#: Digest kind of canonical evidence (``wake-evidence/v1:sha256:…``).
EVIDENCE_DIGEST_KIND = "wake-evidence"
#: Bound of the canonical evidence object.
MAX_EVIDENCE_BYTES = 16 * 1024
#: Column bounds of the producer key and the wake token.
MAX_PRODUCER_KEY_CHARS = KEY_LEN
MAX_WAKE_TOKEN_CHARS = TOKEN_LEN
#: Largest wake version (a signed 64-bit column).
MAX_WAKE_VERSION = 2**63 - 1
#: Evidence fields an effect-completion receipt must carry.
EFFECT_EVIDENCE_FIELDS = (
    "command_id",
    "outcome_version",
    "outcome",
    "safe_error_code",
    "result_digest",
    "effect_owner_kind",
    "effect_handoff_key",
)
#: Outcomes of an effect completion (§15.2, §15.3).
EFFECT_OUTCOMES = ("SUCCEEDED", "FAILED", "OUTCOME_UNKNOWN")


@dataclass(frozen=True)
class SignalSubmission:
    """One producer notification as submitted (scope comes from the credential)."""

    producer_kind: str
    producer_key: str
    wake_token: str
    wake_version: int
    evidence_digest: str
    evidence_reference: str = ""
    evidence_json: str = ""


def evidence_digest(evidence: Mapping[str, Any]) -> str:
    """The digest ``evidence_digest`` must carry for ``evidence``."""
    return versioned_digest(EVIDENCE_DIGEST_KIND, evidence)


def _bad(
    message: str, field_path: str, reason: str = "invalid_wake_signal"
) -> InvalidArgumentError:
    return InvalidArgumentError(message, field_path=field_path, reason=reason)


def parse_evidence(text: str) -> dict[str, Any]:
    """The evidence object of ``text`` (bounded, JSON object, no credentials).

    Raises:
        InvalidArgumentError: not a JSON object, larger than 16 KiB canonically, or
            carrying credential material (the message names paths, never values).
    """
    if len(text.encode("utf-8")) > 4 * MAX_EVIDENCE_BYTES:
        raise _bad("evidence_json is larger than 16 KiB", "evidence_json", "evidence_too_large")
    try:
        value = json.loads(text)
    except ValueError:
        raise _bad("evidence_json is not JSON", "evidence_json") from None
    if not isinstance(value, dict):
        raise _bad("evidence_json must be a JSON object", "evidence_json")
    try:
        canonical = canonical_json(value)
    except CanonicalJsonError:
        raise _bad("evidence_json has no canonical JSON form", "evidence_json") from None
    if len(canonical) > MAX_EVIDENCE_BYTES:
        raise _bad(
            f"evidence_json is {len(canonical)} bytes canonically; the bound is 16 KiB",
            "evidence_json",
            "evidence_too_large",
        )
    found = find_credential_material(value)
    if found:
        raise _bad(
            f"evidence_json contains credential material at {found[0].path} ({found[0].rule})",
            "evidence_json",
            "evidence_credential_rejected",
        )
    return value


def _text(value: str, name: str, bound: int) -> str:
    if not value:
        raise _bad(f"{name} is required", name)
    if len(value) > bound:
        raise _bad(f"{name} is {len(value)} characters; the bound is {bound}", name)
    if value != value.strip() or any(ord(c) < 32 for c in value):
        raise _bad(f"{name} has leading/trailing blanks or control characters", name)
    return value


def _check_effect(s: SignalSubmission, evidence: Mapping[str, Any] | None) -> None:
    """The effect owner's receipt contract (§15.2): envelope and evidence agree."""
    if s.wake_version < 1:
        raise _bad("an effect completion needs wake_version >= 1", "wake_version")
    if evidence is None:
        raise _bad("an effect completion needs evidence_json", "evidence_json")
    missing = [f for f in EFFECT_EVIDENCE_FIELDS if f not in evidence]
    if missing:
        raise _bad(f"effect completion evidence lacks {', '.join(missing)}", "evidence_json")
    if evidence["outcome"] not in EFFECT_OUTCOMES:
        raise _bad(f"outcome must be one of {', '.join(EFFECT_OUTCOMES)}", "evidence_json")
    version = evidence["outcome_version"]
    if isinstance(version, bool) or version != s.wake_version:
        raise _bad("evidence outcome_version must equal wake_version", "evidence_json")
    if evidence["effect_handoff_key"] != s.producer_key:
        raise _bad("evidence effect_handoff_key must equal producer_key", "evidence_json")
    command = evidence["command_id"]
    if not isinstance(command, str) or not command:
        raise _bad("evidence command_id must be a non-empty string", "evidence_json")
    if s.wake_token != f"{command}/{s.wake_version}":
        raise _bad("wake_token must be <command_id>/<outcome_version>", "wake_token")


def validate_submission(s: SignalSubmission, registry: ProducerRegistry) -> NewSignal:
    """Validate ``s`` and build the signal to insert (nothing is written on failure).

    Raises:
        InvalidArgumentError: unknown or internal producer kind, oversized or blank key
            or token, negative version, malformed digest, evidence that is not a bounded
            safe JSON object or whose digest differs, or an effect receipt whose envelope
            and evidence disagree.
    """
    kind = s.producer_kind
    spec = registry.spec(kind)
    if spec is None:
        raise _bad(
            f"unknown producer kind {kind!r}; registered: {', '.join(registry.kinds)}",
            "producer_kind",
            "unknown_producer_kind",
        )
    if not spec.api_submittable:
        raise _bad(
            f"producer kind {kind!r} is internal to the runtime and cannot be submitted",
            "producer_kind",
            "producer_kind_internal",
        )
    key = _text(s.producer_key, "producer_key", MAX_PRODUCER_KEY_CHARS)
    token = _text(s.wake_token, "wake_token", MAX_WAKE_TOKEN_CHARS)
    if not 0 <= s.wake_version <= MAX_WAKE_VERSION:
        raise _bad("wake_version must be between 0 and 2^63-1", "wake_version")
    if not s.evidence_digest:
        raise _bad("evidence_digest is required", "evidence_digest")
    if not is_digest(s.evidence_digest):
        raise _bad("evidence_digest is not a versioned digest", "evidence_digest")
    if len(s.evidence_reference) > KEY_LEN:
        raise _bad(f"evidence_reference exceeds {KEY_LEN} characters", "evidence_reference")
    evidence = parse_evidence(s.evidence_json) if s.evidence_json else None
    if evidence is not None and evidence_digest(evidence) != s.evidence_digest:
        raise _bad(
            "evidence_digest is not the canonical digest of evidence_json "
            f"({EVIDENCE_DIGEST_KIND}/v1 over the canonical JSON object)",
            "evidence_digest",
            "evidence_digest_mismatch",
        )
    if spec.family is ProducerFamily.EFFECT_COMPLETION:
        if kind != EFFECT_COMPLETION_PRODUCER:
            raise InvariantError(f"effect-completion family with producer kind {kind}")
        _check_effect(s, evidence)
    return NewSignal(
        wake_signal_id=f"sig_{uuid.uuid4().hex}",
        producer_kind=kind,
        producer_key=key,
        wake_token=token,
        wake_version=s.wake_version or None,
        evidence_digest=s.evidence_digest,
        evidence_reference=s.evidence_reference or None,
        evidence_json=None if evidence is None else canonical_json(evidence).decode(),
    )
