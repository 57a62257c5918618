"""The runtime binary verifies a plan with the catalog before its first claim (§8.4;
§22.1 "runtime binary binding-fingerprint mismatch rejects claim before mutation").

A plan pins its sealed catalog generation (id and catalog digest) and, per action it
executes, the exact sealed entry (entry digest, binding fingerprint). Before this worker
claims the first step of a plan it reads that generation back from the catalog through
the plan's complete work scope (``CatalogPort.load_snapshot``; a generation of another
scope, or another digest, is not found) and compares:

* the generation is the pinned one (id and catalog digest), in the plan's scope;
* every pinned action has the sealed entry with the same entry digest and binding
  fingerprint — a changed handler binding is never dispatched through a newer handler.

(A pure-compute action this binary has no inline handler for is not a claim refusal: the
step fails closed with ``unsupported_action`` before any write, so the run ends instead of
waiting for a binary that may never come.)

A mismatch refuses the claim: the step is never claimed by this binary, so nothing is
mutated, and the run waits for a compatible worker (the §8.4 release rule keeps one until
such runs end); the refusal is logged once per plan with its reason. Verdicts are cached
per plan digest (plans, sealed generations and this binary are immutable); a catalog that
cannot be reached refuses the claim for now and is asked again next time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.definitions.inputs import CatalogSnapshot
from services.auth import TrustedRuntimeWorkScope
from services.errors import FlowError

if TYPE_CHECKING:  # the catalog client imports the definitions package
    from runtime_svc.catalog_client import CatalogPort

__all__ = ["BinaryCheck", "Mismatch", "plan_mismatches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mismatch:
    """Why this binary may not execute a plan (safe codes only)."""

    action_type: str
    reason: str


def plan_mismatches(plan: ExecutionPlan, snapshot: CatalogSnapshot) -> list[Mismatch]:
    """Compare a plan's pins with the sealed generation the catalog returned (pure).

    Reasons: ``generation_mismatch`` (another generation or digest), ``entry_missing``,
    ``entry_digest_mismatch``, ``binding_fingerprint_mismatch``.
    """
    out: list[Mismatch] = []
    if (snapshot.generation_id, snapshot.catalog_digest) != (
        plan.catalog.generation_id,
        plan.catalog.catalog_digest,
    ):
        out.append(Mismatch("", "generation_mismatch"))
    entries: Mapping[str, Mapping[str, Any]] = {str(e["action_type"]): e for e in snapshot.entries}
    for pin in plan.actions:
        entry = entries.get(pin.action_type)
        if entry is None:
            out.append(Mismatch(pin.action_type, "entry_missing"))
            continue
        if entry.get("entry_digest") != pin.entry_digest:
            out.append(Mismatch(pin.action_type, "entry_digest_mismatch"))
        if (entry.get("binding_fingerprint") or "") != (pin.binding_fingerprint or ""):
            out.append(Mismatch(pin.action_type, "binding_fingerprint_mismatch"))
    return out


class BinaryCheck:
    """Cached per-plan verification of this binary against the catalog.

    Args:
        catalog: the catalog port (``GrpcCatalogClient`` in production).
        max_cached: plan verdicts kept.
    """

    def __init__(self, catalog: CatalogPort, *, max_cached: int = 1024) -> None:
        self._catalog = catalog
        self._max = max_cached
        self._verdicts: dict[str, tuple[Mismatch, ...]] = {}

    def cleared(self, plan: ExecutionPlan) -> bool:
        """Whether this binary's cached verdict on ``plan`` is clear (in memory; no
        verdict yet: ``False``)."""
        return self._verdicts.get(plan.plan_digest) == ()

    async def refusals(
        self, scope: TrustedRuntimeWorkScope, plan: ExecutionPlan
    ) -> tuple[Mismatch, ...]:
        """The reasons this binary may not claim work of ``plan`` (empty: it may).

        A catalog that cannot be reached (or answers with an error) is a refusal for now
        (``catalog_unavailable``), not cached.
        """
        cached = self._verdicts.get(plan.plan_digest)
        if cached is not None:
            return cached
        try:
            snapshot = await self._catalog.load_snapshot(
                scope, plan.catalog.generation_id, plan.catalog.catalog_digest
            )
        except FlowError as exc:
            if exc.code.name in ("NOT_FOUND", "FAILED_PRECONDITION"):
                verdict: tuple[Mismatch, ...] = (Mismatch("", "generation_not_found"),)
            else:
                log.warning("catalog unavailable for the binary check of %s", plan.plan_digest)
                return (Mismatch("", "catalog_unavailable"),)
        else:
            verdict = tuple(plan_mismatches(plan, snapshot))
        if verdict:
            log.error(
                "this runtime binary refuses plan %s: %s",
                plan.plan_digest,
                ", ".join(f"{m.action_type or 'generation'}:{m.reason}" for m in verdict),
            )
        if len(self._verdicts) >= self._max:
            self._verdicts.pop(next(iter(self._verdicts)))
        self._verdicts[plan.plan_digest] = verdict
        return verdict
