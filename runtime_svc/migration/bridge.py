"""The bridge's typed control-plane operations (§20.1-§20.3, §20.9).

Each operation is one short transaction that locks the control record, re-reads the facts
it decides on, applies a pure verdict from :mod:`runtime_svc.migration.gates` and writes
the record with a compare-and-swap — the "rollout controller" of §20.3, driven by
``flowctl deploy``. In order, for an adopter of an element-walking interpreter:

1. :func:`bridge_begin` — enter the additive window: generation 0, new runs legacy-owned,
   V2 admission off, ID-only reads confined to the isolated single-org deployment.
2. :func:`org_backfill_sweep` (repeatable, :mod:`.backfill`) while pre-bridge writers run.
3. :func:`drain_begin` — from now on a pre-bridge binary cannot (re)start.
4. :func:`drain_verify` — the drain gate: zero live pre-bridge writers, zero open
   transactions older than the drain, zero pre-bridge writes since; records the evidence.
5. :func:`org_schema_gate` — final trusted sweep, zero null/mismatched OrgID, adoption of
   every row into the org-keyed ``flow_runs``, the final receipt.
6. :func:`enable_write_protocol` — ``FlowInterviewWriteProtocolGeneration=1``.
7. :func:`set_v2_admission` — only once the bridge is fully rolled out; disabling it
   (rollback) stops new V2 runs and never touches existing ones.

A clean install starts at step 7's state (``origin=clean_install``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import backfill, fleet
from runtime_svc.migration.authority import AuthorityUnproven, DeploymentOrgAuthority
from runtime_svc.migration.control import (
    DeploymentControl,
    Origin,
    Phase,
    lock_control_txn,
    read_control_txn,
    update_control_txn,
)
from runtime_svc.migration.gates import (
    DrainEvidence,
    admission_enable_refusal,
    bridge_begin_refusal,
    drain_gate_refusals,
    org_schema_gate_refusal,
    write_protocol_refusal,
)
from runtime_svc.schema import flow_runs
from runtime_svc.schema_bridge import flow_interviews
from services.db import db_now, transaction
from services.errors import FailedPreconditionError

__all__ = [
    "DRAIN_SETTLE_S",
    "GateRefusedError",
    "bridge_begin",
    "clear_quarantine",
    "count_owned_runs",
    "drain_begin",
    "drain_verify",
    "enable_write_protocol",
    "org_schema_gate",
    "read_control",
    "set_default_owner",
    "set_v2_admission",
]


class GateRefusedError(FailedPreconditionError):
    """A bridge operation's verdict refused it; ``reasons`` are stable codes."""

    def __init__(
        self, operation: str, reasons: Sequence[str], evidence: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(
            f"{operation} refused: {', '.join(reasons)}",
            reason=f"gate_refused.{reasons[0] if reasons else 'unknown'}",
        )
        self.operation = operation
        self.reasons = tuple(reasons)
        self.evidence = dict(evidence or {})


async def read_control(engine: AsyncEngine) -> DeploymentControl:
    async with transaction(engine, readonly=True) as conn:
        return await read_control_txn(conn)


async def count_owned_runs(engine: AsyncEngine) -> dict[str, int]:
    """Runs per execution owner across the deployment (deployment-level evidence)."""
    t = flow_runs.c
    async with transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            select(t.execution_owner, func.count()).group_by(t.execution_owner)
        )
        return {str(owner): int(n) for owner, n in rows}


async def bridge_begin(engine: AsyncEngine) -> DeploymentControl:
    """Enter the pre-bridge additive window (adopter onboarding)."""
    v2 = (await count_owned_runs(engine)).get(ExecutionOwner.FLOW_RUNTIME_V2.code, 0)
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        refusal = bridge_begin_refusal(control, v2)
        if refusal is not None:
            raise GateRefusedError("bridge begin", [refusal], {"v2_owned_runs": v2})
        now = await db_now(conn)
        await update_control_txn(
            conn,
            control.state_version,
            {
                "write_protocol_generation": 0,
                "phase": Phase.ADDITIVE,
                "origin": Origin.LEGACY_ADOPTION,
                "default_new_run_owner": ExecutionOwner.LEGACY_INTERPRETER,
                "v2_admission_enabled": False,
                "isolated_single_org": True,
                "deployment_org_id": None,
                "quarantine_reason": None,
                "drain_started_at": None,
                "drained_at": None,
                "drain_evidence": None,
                "org_backfill_receipt_id": None,
                "org_schema_verified_at": None,
                "write_protocol_enabled_at": None,
                "admission_changed_at": now,
            },
            now,
        )
        return await read_control_txn(conn)


async def drain_begin(engine: AsyncEngine, *, restart: bool = False) -> DeploymentControl:
    """Start draining: pre-bridge binaries can no longer register (start).

    ``restart`` moves the drain start to now — after a refused drain gate, once the
    straggling pre-bridge writer named in its evidence is gone."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        if control.phase is not Phase.ADDITIVE:
            raise GateRefusedError("drain begin", [f"phase_is_{control.phase.value}"])
        if control.drain_started_at is None or restart:
            now = await db_now(conn)
            await update_control_txn(conn, control.state_version, {"drain_started_at": now}, now)
        return await read_control_txn(conn)


#: Minimum time between the drain start and the drain gate: MySQL-family servers serve
#: ``information_schema.INNODB_TRX`` from a cache refreshed at most every 0.1 s, so a
#: snapshot taken too soon after the drain start could predate it.
DRAIN_SETTLE_S = 1.0


async def drain_verify(
    engine: AsyncEngine, *, settle_s: float = DRAIN_SETTLE_S
) -> DeploymentControl:
    """The drain gate: record authoritative zero-old-writer evidence, or refuse."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        now = await db_now(conn)
        started = control.drain_started_at
        if started is not None and (now - started).total_seconds() < settle_s:
            raise GateRefusedError("drain gate", ["drain_too_recent"])
        writers = await fleet.live_writers_txn(conn, now)
        pre_bridge = [w for w in writers if int(w["write_protocol_generation"]) < 1]
        open_txns, kind = (None, "drain_not_started")
        writes = 0
        if started is not None:
            open_txns, kind = await fleet.open_transactions_before(conn, started, now)
            t = flow_interviews.c
            writes = int(
                (
                    await conn.execute(
                        select(func.count()).where(
                            or_(t.created_at >= started, t.updated_at >= started)
                        )
                    )
                ).scalar_one()
            )
        evidence = DrainEvidence(
            pre_bridge,
            open_txns,
            writes,
            kind,
            {
                "observed_at": now.isoformat(),
                "live_writers": len(writers),
                "bridge_writers": len(writers) - len(pre_bridge),
            },
        )
        refusals = drain_gate_refusals(control, evidence)
        if refusals:
            raise GateRefusedError("drain gate", refusals, evidence.to_dict())
        await update_control_txn(
            conn,
            control.state_version,
            {"phase": Phase.DRAINED, "drained_at": now, "drain_evidence": evidence.to_dict()},
            now,
        )
        return await read_control_txn(conn)


async def org_schema_gate(
    engine: AsyncEngine,
    authority: DeploymentOrgAuthority | AuthorityUnproven,
    store: LegacyInterviewStore,
) -> backfill.BackfillReceipt:
    """Final trusted sweep, zero-null/zero-mismatch proof, adoption, final receipt."""
    control = await read_control(engine)
    refusal = org_schema_gate_refusal(control)
    if refusal is not None:
        raise GateRefusedError("org-schema gate", [refusal])
    sweep = await backfill.org_backfill_sweep(engine, authority, kind="final_sweep")
    if not sweep.complete or not isinstance(authority, DeploymentOrgAuthority):
        raise GateRefusedError("org-schema gate", ["rollout_quarantined"], sweep.to_dict())
    async with transaction(engine, readonly=True) as conn:
        nulls, mismatches = await backfill.count_unstamped_txn(conn, authority.org_id)
    if nulls or mismatches:
        async with transaction(engine) as conn:
            await backfill.quarantine_txn(conn, "pre_bridge_writes_after_drain")
        raise GateRefusedError(
            "org-schema gate",
            ["null_or_mismatched_org_after_final_sweep"],
            {"null_count": nulls, "mismatch_count": mismatches},
        )
    adoption = await backfill.adopt_prebridge_rows(engine, authority, store)
    if adoption.refused:
        raise GateRefusedError(
            "org-schema gate", ["rows_not_adoptable"], {"refused": adoption.refused}
        )
    receipt = backfill.BackfillReceipt(
        f"obr-final-{sweep.receipt_id.removeprefix('obr-')}",
        "final",
        "complete",
        authority.digest,
        authority.org_id,
        sweep.scanned,
        sweep.stamped,
        sweep.already_matching,
        0,
        0,
        adoption.adopted,
        {"final_sweep_receipt_id": sweep.receipt_id},
    )
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        refusal = org_schema_gate_refusal(control)
        if refusal is not None:
            raise GateRefusedError("org-schema gate", [refusal])
        now = await db_now(conn)
        await backfill.insert_receipt_txn(conn, receipt, now)
        await update_control_txn(
            conn,
            control.state_version,
            {
                "phase": Phase.ORG_SCHEMA_VERIFIED,
                "deployment_org_id": authority.org_id,
                "org_backfill_receipt_id": receipt.receipt_id,
                "org_schema_verified_at": now,
            },
            now,
        )
    return receipt


async def enable_write_protocol(engine: AsyncEngine) -> DeploymentControl:
    """``FlowInterviewWriteProtocolGeneration=1`` after both gates (§20.3 5)."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        refusal = write_protocol_refusal(control)
        if refusal is not None:
            raise GateRefusedError("write protocol", [refusal])
        now = await db_now(conn)
        await update_control_txn(
            conn,
            control.state_version,
            {
                "write_protocol_generation": 1,
                "phase": Phase.WRITE_PROTOCOL_ENABLED,
                "write_protocol_enabled_at": now,
                "isolated_single_org": False,
            },
            now,
        )
        return await read_control_txn(conn)


async def set_v2_admission(engine: AsyncEngine, *, enabled: bool) -> DeploymentControl:
    """Enable (gated) or disable (always) the admission of new V2 runs (§20.9)."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        now = await db_now(conn)
        if enabled:
            writers = await fleet.live_writers_txn(conn, now)
            refusal = admission_enable_refusal(
                control, [int(w["write_protocol_generation"]) for w in writers]
            )
            if refusal is not None:
                raise GateRefusedError("V2 admission", [refusal])
        if control.v2_admission_enabled != enabled:
            await update_control_txn(
                conn,
                control.state_version,
                {"v2_admission_enabled": enabled, "admission_changed_at": now},
                now,
            )
        return await read_control_txn(conn)


async def set_default_owner(engine: AsyncEngine, owner: ExecutionOwner) -> DeploymentControl:
    """The owner of new runs outside any cohort row (§20.1 "Default V2 ownership")."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        if owner is ExecutionOwner.FLOW_RUNTIME_V2 and not control.gates_passed:
            raise GateRefusedError("default owner", ["write_protocol_not_enabled"])
        now = await db_now(conn)
        if control.default_new_run_owner is not owner:
            await update_control_txn(
                conn, control.state_version, {"default_new_run_owner": owner}, now
            )
        return await read_control_txn(conn)


async def clear_quarantine(engine: AsyncEngine, reason: str) -> DeploymentControl:
    """Clear a quarantine after investigation; ``reason`` must name the current one."""
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        if control.quarantine_reason is None:
            return control
        if control.quarantine_reason != reason:
            raise GateRefusedError("clear quarantine", ["quarantine_reason_mismatch"])
        now = await db_now(conn)
        await update_control_txn(conn, control.state_version, {"quarantine_reason": None}, now)
        return await read_control_txn(conn)
