"""Pure decisions of the bridge, the gates and rollback (§20.3, §20.6, §20.9, §23).

Each function takes decoded facts and returns a refusal reason (or a verdict value);
:mod:`runtime_svc.migration.bridge` reads the facts under the control-record lock and
applies the verdict. Refusals are stable machine codes, reported verbatim.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.migration.control import DeploymentControl, Origin, Phase

__all__ = [
    "DrainEvidence",
    "RollbackVerdict",
    "admission_enable_refusal",
    "bridge_begin_refusal",
    "drain_gate_refusals",
    "org_schema_gate_refusal",
    "rollback_verdict",
    "startup_refusal",
    "v2_admission_refusal",
    "write_protocol_refusal",
]


def v2_admission_refusal(control: DeploymentControl, binary_generation: int) -> str | None:
    """Why a new V2 run may not be admitted now (``None``: it may).

    V2 admission needs a bridge-capable binary *and* both gates passed with
    ``FlowInterviewWriteProtocolGeneration >= 1`` (§20.3 5, §22.2 "V2 admission is
    impossible on the pre-bridge release"), no quarantine, and admission enabled.
    """
    if binary_generation < 1:
        return "binary_pre_bridge"
    if control.quarantined:
        return "rollout_quarantined"
    if control.generation < 1 or control.phase is not Phase.WRITE_PROTOCOL_ENABLED:
        return "write_protocol_not_enabled"
    if not control.v2_admission_enabled:
        return "v2_admission_disabled"
    return None


def startup_refusal(control: DeploymentControl, binary_generation: int) -> str | None:
    """Why a binary of ``binary_generation`` may not start (§20.3 3, §22.8 "a pre-bridge
    binary cannot restart after the write-protocol gate").

    A pre-bridge binary (generation 0) is refused from the moment the drain starts; any
    binary older than the recorded generation is refused always.
    """
    if binary_generation < control.generation:
        return "binary_older_than_write_protocol"
    if binary_generation < 1 and (
        control.drain_started_at is not None or control.phase.rank > Phase.ADDITIVE.rank
    ):
        return "pre_bridge_binary_after_drain"
    return None


@dataclass(frozen=True)
class DrainEvidence:
    """Authoritative zero-old-writer evidence (§20.3 3, §22.8)."""

    live_pre_bridge_writers: Sequence[Mapping[str, Any]]
    open_transactions_before_drain: int | None
    prebridge_writes_since_drain: int
    transaction_evidence_kind: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "live_pre_bridge_writers": [dict(w) for w in self.live_pre_bridge_writers],
            "open_transactions_before_drain": self.open_transactions_before_drain,
            "prebridge_writes_since_drain": self.prebridge_writes_since_drain,
            "transaction_evidence_kind": self.transaction_evidence_kind,
            **dict(self.details),
        }


def drain_gate_refusals(control: DeploymentControl, evidence: DrainEvidence) -> list[str]:
    """Every reason the drain gate cannot pass (empty: it passes)."""
    out = []
    if control.phase is not Phase.ADDITIVE:
        out.append(f"phase_is_{control.phase.value}")
    if control.drain_started_at is None:
        out.append("drain_not_started")
    if control.quarantined:
        out.append("rollout_quarantined")
    if evidence.live_pre_bridge_writers:
        out.append("pre_bridge_writers_live")
    if evidence.open_transactions_before_drain is None:
        out.append("transaction_evidence_unavailable")
    elif evidence.open_transactions_before_drain > 0:
        out.append("transactions_open_since_before_drain")
    if evidence.prebridge_writes_since_drain > 0:
        out.append("pre_bridge_writes_after_drain_start")
    return out


def org_schema_gate_refusal(control: DeploymentControl) -> str | None:
    """Whether the final OrgID sweep and adoption may run now."""
    if control.quarantined:
        return "rollout_quarantined"
    if control.phase is not Phase.DRAINED:
        return f"phase_is_{control.phase.value}"
    return None


def write_protocol_refusal(control: DeploymentControl) -> str | None:
    """Whether ``FlowInterviewWriteProtocolGeneration=1`` may be enabled (§20.3 5)."""
    if control.quarantined:
        return "rollout_quarantined"
    if control.drained_at is None:
        return "drain_gate_not_passed"
    if control.phase is not Phase.ORG_SCHEMA_VERIFIED or control.org_backfill_receipt_id is None:
        return "org_schema_gate_not_passed"
    return None


def admission_enable_refusal(
    control: DeploymentControl, live_generations: Sequence[int]
) -> str | None:
    """Whether new V2 admission may be (re-)enabled: both gates, and the bridge fully
    rolled out — every live registered writer carries generation >= 1 (§20.3 10)."""
    if not control.gates_passed:
        return "write_protocol_not_enabled"
    if any(g < 1 for g in live_generations):
        return "pre_bridge_writers_live"
    return None


def bridge_begin_refusal(control: DeploymentControl, v2_rows: int) -> str | None:
    """Whether the deployment may enter the pre-bridge additive window (adopter
    onboarding): never once a V2-owned run exists (no run switches owner, and a
    pre-bridge fleet must never meet a V2 row)."""
    if v2_rows > 0:
        return "v2_owned_runs_exist"
    if control.origin is Origin.LEGACY_ADOPTION and control.phase is not Phase.ADDITIVE:
        return f"phase_is_{control.phase.value}"
    return None


@dataclass(frozen=True)
class RollbackVerdict:
    """``flowctl deploy rollback-check`` (§20.9, §22.2 V22.2-30)."""

    allowed: bool
    reasons: tuple[str, ...]
    target_version: str
    target_generation: int | None
    v2_ownership_possible: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "allowed": self.allowed,
            "reasons": list(self.reasons),
            "target_version": self.target_version,
            "target_write_protocol_generation": self.target_generation,
            "v2_ownership_possible": self.v2_ownership_possible,
        }


def rollback_verdict(
    target_version: str,
    target_generation: int | None,
    control: DeploymentControl,
    *,
    v2_rows: int,
    legacy_rows: int,
) -> RollbackVerdict:
    """Reject a rollback target that could corrupt V2 rows or strand an epoch.

    V2 ownership is *possible* once the write protocol is enabled or any V2-owned run
    exists; then the target must be bridge-capable (generation >= 1). An unknown target
    release cannot prove it and is rejected. The target must also be able to drain both
    epochs still present (a pre-bridge target cannot drain adopted legacy runs either).
    """
    possible = control.generation >= 1 or control.v2_admission_enabled or v2_rows > 0
    reasons: list[str] = []
    if target_generation is None:
        reasons.append("unknown_release")
    elif target_generation < control.generation:
        reasons.append("target_older_than_write_protocol")
    if target_generation is not None and target_generation < 1:
        if possible:
            reasons.append("pre_bridge_target_while_v2_ownership_possible")
        if legacy_rows > 0 and control.origin is Origin.LEGACY_ADOPTION:
            reasons.append("pre_bridge_target_cannot_drain_adopted_legacy_runs")
    if control.default_new_run_owner is ExecutionOwner.FLOW_RUNTIME_V2 and (
        target_generation is not None and target_generation < 1
    ):
        reasons.append("default_owner_is_v2")
    unique = tuple(dict.fromkeys(reasons))
    return RollbackVerdict(not unique, unique, target_version, target_generation, possible)
