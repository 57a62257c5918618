"""Runtime handler availability and the §8.4 release rule.

Each runtime binary publishes the exact
``(RuntimeWorkBindingDigest, CatalogGenerationId, ActionType, HandlerRef, EntryDigest,
BindingFingerprint)`` tuples it can execute. "A candidate binary must prove support for
every generation used by work it can claim": :func:`verify_runtime_binary` answers with
the required tuples the binary lacks (exact match on all six components — a differing
fingerprint or entry digest is a missing tuple, never a fallback to a newer handler),
and :func:`binding_gaps` explains each gap of one sealed generation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from .ids import (
    ActionType,
    BindingFingerprint,
    CatalogGenerationId,
    EntryDigest,
    HandlerRef,
    RuntimeWorkBindingDigest,
)
from .sealed import SealedGeneration

__all__ = [
    "BindingGap",
    "BindingGapReason",
    "RuntimeHandlerTuple",
    "binding_gaps",
    "required_tuples",
    "verify_runtime_binary",
]


class RuntimeHandlerTuple(NamedTuple):
    """One executable (generation, entry, handler) combination (§8.4)."""

    runtime_work_binding_digest: RuntimeWorkBindingDigest
    catalog_generation_id: CatalogGenerationId
    action_type: ActionType
    handler_ref: HandlerRef
    entry_digest: EntryDigest
    binding_fingerprint: BindingFingerprint


class BindingGapReason(IntEnum):
    """Why a binary cannot execute an entry (numbers mirror the proto)."""

    UNSPECIFIED = 0
    HANDLER_MISSING = 1
    FINGERPRINT_MISMATCH = 2
    ENTRY_DIGEST_MISMATCH = 3
    CAPABILITY_VERSION_TOO_LOW = 4


@dataclass(frozen=True, slots=True)
class BindingGap:
    """One executable entry of a generation that a binary cannot execute."""

    action_type: ActionType
    entry_digest: EntryDigest
    binding_fingerprint: BindingFingerprint
    reason: BindingGapReason


def required_tuples(generation: SealedGeneration) -> tuple[RuntimeHandlerTuple, ...]:
    """The tuples a binary must publish to execute every executable entry of a generation.

    Contract-only entries are absent: they never dispatch.
    """
    out: list[RuntimeHandlerTuple] = []
    for e in generation.entries:
        if e.handler_binding is None or e.binding_fingerprint is None:
            continue
        out.append(
            RuntimeHandlerTuple(
                generation.binding_digest,
                generation.generation_id,
                e.action_type,
                HandlerRef(e.handler_binding.handler_ref),
                e.entry_digest,
                e.binding_fingerprint,
            )
        )
    return tuple(out)


def verify_runtime_binary(
    available_tuples: Iterable[RuntimeHandlerTuple], required_tuples: Iterable[RuntimeHandlerTuple]
) -> list[RuntimeHandlerTuple]:
    """The required tuples the binary does not publish, sorted and without duplicates.

    An empty list proves support (§8.4 release rule).
    """
    available = set(available_tuples)
    return sorted({t for t in required_tuples if t not in available})


def binding_gaps(
    generation: SealedGeneration,
    available_tuples: Iterable[RuntimeHandlerTuple],
    *,
    supported_capability_version: int | None = None,
) -> tuple[BindingGap, ...]:
    """Explain every executable entry of ``generation`` the binary cannot execute.

    Args:
        generation: the sealed generation the binary's claimable work uses.
        available_tuples: what the binary publishes.
        supported_capability_version: the highest capability generation the binary
            supports; entries needing more are gaps even with a matching tuple.
    """
    available = set(available_tuples)
    by_action: dict[tuple[str, str, str], list[RuntimeHandlerTuple]] = {}
    for t in available:
        by_action.setdefault(
            (t.runtime_work_binding_digest, t.catalog_generation_id, t.action_type), []
        ).append(t)
    gaps: list[BindingGap] = []
    for want in required_tuples(generation):
        entry = generation.get_entry(want.action_type)
        reason: BindingGapReason | None = None
        if want in available:
            if (
                supported_capability_version is not None
                and entry is not None
                and entry.descriptor.minimum_capability_version > supported_capability_version
            ):
                reason = BindingGapReason.CAPABILITY_VERSION_TOO_LOW
        else:
            published = by_action.get(
                (want.runtime_work_binding_digest, want.catalog_generation_id, want.action_type), []
            )
            if not published:
                reason = BindingGapReason.HANDLER_MISSING
            elif any(t.binding_fingerprint == want.binding_fingerprint for t in published):
                reason = BindingGapReason.ENTRY_DIGEST_MISMATCH
            else:
                reason = BindingGapReason.FINGERPRINT_MISMATCH
        if reason is not None:
            gaps.append(
                BindingGap(want.action_type, want.entry_digest, want.binding_fingerprint, reason)
            )
    return tuple(gaps)
