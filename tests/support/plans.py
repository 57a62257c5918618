"""Store a compiled plan the way activation does, without the definitions service: the
Flow version, its plan row (:func:`runtime_svc.definitions.repository.plan_row_values`)
and, optionally, an ACTIVE activation — what ``StartRun`` and trigger admission resolve.
Shared by the worker, Bounded Atomic and bench setups."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.definitions import repository as repo
from services import db
from services.auth import TrustedRuntimeWorkScope

__all__ = ["StoredPlan", "store_plan"]


@dataclass(frozen=True)
class StoredPlan:
    """A stored plan of one org (and its Flow version)."""

    scope: TrustedRuntimeWorkScope
    plan_id: str
    plan: ExecutionPlan
    flow_version_id: str

    @property
    def org(self) -> str:
        return self.scope.org_id


async def store_plan(
    engine: AsyncEngine,
    source: dict[str, Any],
    plan: ExecutionPlan,
    *,
    activate: bool = False,
    label: str = "test",
) -> StoredPlan:
    """Insert the Flow version of ``source``, ``plan``'s row and (``activate``) an ACTIVE
    activation, in one transaction."""
    b = plan.binding
    scope = TrustedRuntimeWorkScope(
        org_id=b.org_id,
        app_installation_id=b.app_installation_id,
        runtime_capability_id=b.runtime_capability_id,
        runtime_work_binding_digest=b.binding_digest,
    )
    suffix = uuid.uuid4().hex[:12]
    version_id, plan_id = f"fv-{suffix}", f"plan-{suffix}"
    async with db.transaction(engine) as conn:
        now = await db.db_now(conn)
        await repo.insert_flow_version_txn(
            conn,
            repo.FlowVersionRow(
                org_id=b.org_id,
                flow_version_id=version_id,
                flow_api_name=plan.flow.api_name,
                version_number=int(source.get("version", 1)),
                source_json=json.dumps(source),
                metadata_digest=plan.flow.metadata_digest,
                label=label,
                created_at=now,
            ),
        )
        await repo.insert_plan_txn(
            conn,
            repo.plan_row_values(plan, plan_id=plan_id, flow_version_id=version_id, created_at=now),
        )
        if activate:
            inserted = await repo.insert_activation_txn(
                conn,
                {
                    "org_id": b.org_id,
                    "app_installation_id": b.app_installation_id,
                    "runtime_capability_id": b.runtime_capability_id,
                    "runtime_work_binding_digest": b.binding_digest,
                    "activation_id": f"act-{suffix}",
                    "flow_version_id": version_id,
                    "flow_api_name": plan.flow.api_name,
                    "trigger_binding_digest": plan.trigger_binding_digest,
                    "plan_id": plan_id,
                    "state": repo.ACTIVE,
                    "active_slot": 1,
                    "attempt_diagnostics": None,
                    "state_version": 0,
                    "created_at": now,
                    "activated_at": now,
                    "superseded_at": None,
                },
            )
            assert inserted, "an ACTIVE activation of this Flow already exists"
    return StoredPlan(scope, plan_id, plan, version_id)
