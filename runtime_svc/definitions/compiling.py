"""One compile of one Flow version, and the storage of its plan (§7.2-§7.4).

:class:`PlanCompiler` is the only caller of :func:`runtime_svc.compiler.compile_plan` in
the service: CompileFlowVersion, activation's re-compile and the inventory all come
through :meth:`PlanCompiler.compile`, so they share one compiler contract.

Plans are stored by :meth:`PlanCompiler.store` with insert-if-absent on the unique plan
identity tuple (org, Flow version, compiler version, binding digest, catalog generation
and digest, trigger binding digest, policy version): an identical re-compile returns the
existing row, and there is no path that updates a plan.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import (
    COMPILER_VERSION,
    CompilerInputs,
    ExecutionPlan,
    PlanCompileError,
    compile_plan,
)
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions._util import Db, bounded_json, new_id
from runtime_svc.definitions.inputs import (
    DEFAULT_WAIT_PRODUCERS,
    CatalogSnapshot,
    build_compiler_inputs,
)
from runtime_svc.definitions.policy import PolicyGeneration
from runtime_svc.definitions.source import MAX_SUBFLOW_VERSIONS, SubflowRef, collect_subflows
from runtime_svc.schema import MAX_PLAN_PAYLOAD_BYTES, MAX_SUMMARY_BYTES
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now
from services.errors import ConflictError, FailedPreconditionError

__all__ = ["MAX_SUBFLOW_VERSIONS", "CompileResult", "PlanCompiler"]

#: ``(plan or error, the inputs used, the compiled document)``.
CompileResult = tuple[ExecutionPlan | PlanCompileError, CompilerInputs, Mapping[str, Any]]


class PlanCompiler(Db):
    """Compiles stored Flow versions and stores valid plans."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        compiler_version: str = COMPILER_VERSION,
        wait_producers: Sequence[Mapping[str, str]] = DEFAULT_WAIT_PRODUCERS,
    ) -> None:
        super().__init__(engine)
        self.compiler_version = compiler_version
        self._wait_producers = tuple(wait_producers)

    async def subflow_closure(
        self, org_id: str, document: Mapping[str, Any]
    ) -> tuple[list[Mapping[str, Any]], dict[tuple[str, int], str]]:
        """Sources (and version ids) of every registered Flow version reachable by Subflow."""

        async def read(
            conn: AsyncConnection,
        ) -> tuple[list[Mapping[str, Any]], dict[tuple[str, int], str]]:
            async def fetch(ref: SubflowRef) -> tuple[Mapping[str, Any], str] | None:
                row = await repo.get_flow_version_by_number_txn(
                    conn, org_id, ref.api_name, ref.version
                )
                if row is None:
                    return None
                return json.loads(row.source_json), row.flow_version_id

            return await collect_subflows(document, fetch)

        return await self._read(read)

    async def compile(
        self,
        flow: repo.FlowVersionRow,
        snapshot: CatalogSnapshot,
        policy: PolicyGeneration,
        *,
        run_atomically: bool | None = None,
    ) -> tuple[ExecutionPlan | PlanCompileError, CompilerInputs, Mapping[str, Any]]:
        document: dict[str, Any] = json.loads(flow.source_json)
        if run_atomically is not None:
            document = {**document, "run_atomically": run_atomically}
        subflows, _ = await self.subflow_closure(flow.org_id, document)
        inputs = build_compiler_inputs(
            snapshot,
            policy.compiler_document(),
            subflows,
            flow_versions={flow.flow_api_name: flow.version_number},
            wait_producers=self._wait_producers,
        )
        try:
            plan = await asyncio.to_thread(
                compile_plan, document, inputs, compiler_version=self.compiler_version
            )
        except PlanCompileError as exc:
            return exc, inputs, document
        return plan, inputs, document

    @staticmethod
    def check_scope(plan: ExecutionPlan, scope: TrustedRuntimeWorkScope) -> None:
        b = plan.binding
        bound = (b.org_id, b.app_installation_id, b.runtime_capability_id, b.binding_digest)
        trusted = (
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
        )
        if bound != trusted:
            raise FailedPreconditionError(
                "the catalog generation is bound to another work scope than the caller's",
                reason="scope_mismatch",
            )

    def _plan_values(
        self, flow: repo.FlowVersionRow, plan: ExecutionPlan, now: Any
    ) -> dict[str, Any]:
        if len(repo.to_json(plan.to_dict()).encode()) > MAX_PLAN_PAYLOAD_BYTES:
            raise FailedPreconditionError(
                f"the compiled plan exceeds {MAX_PLAN_PAYLOAD_BYTES} bytes",
                reason="plan_too_large",
            )
        return repo.plan_row_values(
            plan,
            plan_id=new_id("plan"),
            flow_version_id=flow.flow_version_id,
            created_at=now,
            diagnostic_summary=bounded_json(
                [d.to_dict() for d in plan.diagnostics], MAX_SUMMARY_BYTES
            ),
        )

    async def store(self, flow: repo.FlowVersionRow, plan: ExecutionPlan) -> repo.PlanRow:
        """Insert-if-absent on the plan identity tuple; an identical compile reuses the row."""

        async def txn(conn: AsyncConnection) -> repo.PlanRow:
            values = self._plan_values(flow, plan, await db_now(conn))
            identity = {
                k: values[k]
                for k in (
                    "org_id",
                    "flow_version_id",
                    "compiler_version",
                    "runtime_work_binding_digest",
                    "catalog_generation_id",
                    "catalog_digest",
                    "trigger_binding_digest",
                    "policy_version",
                )
            }
            await repo.insert_plan_txn(conn, values)
            row = await repo.get_plan_by_identity_txn(conn, identity)
            if row is None:
                raise ConflictError("plan id collision; retry", entity="FlowExecutionPlan")
            if row.plan_digest != plan.plan_digest:
                raise FailedPreconditionError(
                    f"plan {row.plan_id} has the same identity tuple but digest "
                    f"{row.plan_digest}, not {plan.plan_digest}: the compiler's behaviour "
                    "changed without a compiler-version change",
                    reason="plan_identity_conflict",
                )
            return row

        return await self._txn(txn)
