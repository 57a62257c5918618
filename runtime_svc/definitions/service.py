"""The definitions service: the one entry point the gRPC servicer (and later issues) use.

It composes the stores — :class:`~.policy_store.PolicyStore`,
:class:`~.compiling.PlanCompiler`, :class:`~.activation.Activations` — with the catalog
client. Every public method takes the *trusted* org or work scope (derived by the API
layer from the caller's credential, never from a request body) and opens its own bounded
transactions; catalog calls happen outside transactions, so no database connection is
held across the network.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import (
    COMPILER_VERSION,
    ExecutionPlan,
    ExecutionProfile,
    PlanCompileError,
)
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions._util import Db, clamp_page_size, decode_token, encode_token, new_id
from runtime_svc.definitions.activation import ActivationOutcome, Activations, PlanLookup
from runtime_svc.definitions.compiling import PlanCompiler
from runtime_svc.definitions.errors import FlowVersionConflictError
from runtime_svc.definitions.inputs import CatalogSnapshot
from runtime_svc.definitions.inventory import (
    DiagnosticValue,
    InventoryRow,
    diagnostics_of,
    inventory_row,
)
from runtime_svc.definitions.policy import PolicyGeneration
from runtime_svc.definitions.policy_store import PolicyStore
from runtime_svc.definitions.source import FlowSourceInfo, parse_source_json
from runtime_svc.schema import LABEL_LEN, MAX_FLOW_SOURCE_BYTES, runtime_requests
from runtime_svc.waits.registry import ProducerRegistry
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now
from services.digest import is_digest
from services.errors import ConflictError, InvalidArgumentError, NotFoundError
from services.request_dedupe import RequestKey, RequestLedger

if TYPE_CHECKING:  # the catalog client imports this package (CatalogSnapshot)
    from runtime_svc.catalog_client import CatalogPort

__all__ = ["CompileOutcome", "DefinitionService", "PlanView"]

T = TypeVar("T")

#: Default/maximum page sizes of ListFlowVersions and GetInventory.
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 50, 500
MAX_INVENTORY_PAGE = 100


@dataclass(frozen=True)
class CompileOutcome:
    """Result of CompileFlowVersion: a stored plan, or the diagnostics of a failed compile."""

    compiled: bool
    plan: repo.PlanRow | None
    diagnostics: tuple[DiagnosticValue, ...]


@dataclass(frozen=True)
class PlanView:
    """A stored plan with the Flow-version ids of its transitive subflow plans."""

    row: repo.PlanRow
    plan: ExecutionPlan
    subflow_version_ids: Mapping[tuple[str, int], str]


def _visible(row: repo.PlanRow, visible_to: Mapping[str, str | None] | None) -> bool:
    """Whether every scope component the caller carries equals the plan's."""
    if visible_to is None:
        return True
    plan_scope = {
        "org_id": row.scope.org_id,
        "app_installation_id": row.scope.app_installation_id,
        "runtime_capability_id": row.scope.runtime_capability_id,
        "runtime_work_binding_digest": row.scope.runtime_work_binding_digest,
    }
    return all(v is None or plan_scope.get(k) == v for k, v in visible_to.items())


class DefinitionService(Db):
    """Flow versions, runtime policies, plans, activations and inventory of one database."""

    def __init__(
        self,
        engine: AsyncEngine,
        catalog: CatalogPort,
        *,
        compiler_version: str = COMPILER_VERSION,
        wait_producers: Sequence[Mapping[str, str]] | None = None,
        producers: ProducerRegistry | None = None,
    ) -> None:
        super().__init__(engine)
        self._catalog = catalog
        self._ledger = RequestLedger(runtime_requests)
        self.policies = PolicyStore(engine)
        registry = producers or ProducerRegistry()
        self.compiler = PlanCompiler(
            engine,
            compiler_version=compiler_version,
            wait_producers=(
                registry.compiler_producers() if wait_producers is None else wait_producers
            ),
        )
        self.activations = Activations(
            engine,
            catalog,
            self.compiler,
            self.policies,
            self._flow_version,
            self._lookup_plan,
            producers=registry,
        )

    # --- request deduplication -------------------------------------------------------------

    async def once(
        self,
        key: RequestKey,
        operation: Callable[[], Awaitable[T]],
        encode: Callable[[T], bytes],
    ) -> bytes:
        """Run an idempotent definitions operation once per request (``services.request_dedupe``
        reserve → operation → complete): the operations span catalog calls and several
        transactions, so the ledger first fixes the body digest (a reused id with another
        body is refused before anything happens), a retry of a completed request replays
        the original response, and a retry of an unfinished one runs the idempotent
        operation again; the first completed response is the one every retry gets.

        Raises:
            RequestIdReusedError: the id was used with another body.
        """
        return await self._ledger.once(self._engine, key, operation, encode)

    # --- policies -------------------------------------------------------------------------

    async def current_policy(self, org_id: str) -> PolicyGeneration:
        """The org's newest policy generation; the default is seeded on first use."""
        return await self.policies.current(org_id)

    async def put_policy(self, org_id: str, document: Mapping[str, Any]) -> PolicyGeneration:
        """Publish a policy document (a new generation when it differs from the current)."""
        return await self.policies.put(org_id, document)

    # --- activation -------------------------------------------------------------------------

    async def activate_flow_version(
        self,
        scope: TrustedRuntimeWorkScope,
        request_id: str,
        flow_version_id: str,
        plan_id: str,
        plan_digest: str,
    ) -> ActivationOutcome:
        """See :meth:`.activation.Activations.activate`."""
        return await self.activations.activate(
            scope, request_id, flow_version_id, plan_id, plan_digest
        )

    async def deactivate_flow_version(
        self,
        org_id: str,
        flow_version_id: str,
        *,
        app_installation_id: str | None = None,
        runtime_capability_id: str | None = None,
    ) -> repo.ActivationRow:
        """See :meth:`.activation.Activations.deactivate`."""
        return await self.activations.deactivate(
            org_id,
            flow_version_id,
            app_installation_id=app_installation_id,
            runtime_capability_id=runtime_capability_id,
        )

    async def _lookup_plan(self, scope: TrustedRuntimeWorkScope, plan_ref: str) -> PlanLookup:
        # A plan of another installation, capability or binding answers like a missing one.
        visible = {
            "org_id": scope.org_id,
            "app_installation_id": scope.app_installation_id,
            "runtime_capability_id": scope.runtime_capability_id,
            "runtime_work_binding_digest": scope.runtime_work_binding_digest,
        }
        view = await self.get_plan(scope.org_id, plan_ref, visible_to=visible)
        return PlanLookup(view.row, view.plan)

    # --- Flow versions, compile, plans, inventory ---------------------------------------------

    async def register_flow_version(
        self, org_id: str, flow_api_name: str, source_json: str, label: str = ""
    ) -> repo.FlowVersionRow:
        """Store an immutable Flow version (idempotent on API name, version and source).

        Raises:
            InvalidArgumentError: bad JSON or an invalid source (path named), an API name
                that differs from the source's, an oversized source or label.
            FlowVersionConflictError: the version exists with another source.
        """
        if len(source_json.encode("utf-8")) > MAX_FLOW_SOURCE_BYTES:
            raise InvalidArgumentError(
                f"source_json exceeds {MAX_FLOW_SOURCE_BYTES} bytes", field_path="source_json"
            )
        if len(label) > LABEL_LEN:
            raise InvalidArgumentError(f"label exceeds {LABEL_LEN} characters", field_path="label")
        info = parse_source_json(source_json)
        if flow_api_name and flow_api_name != info.api_name:
            raise InvalidArgumentError(
                f"flow_api_name {flow_api_name!r} differs from the source's api_name "
                f"{info.api_name!r}",
                field_path="flow_api_name",
            )

        async def txn(conn: AsyncConnection) -> repo.FlowVersionRow:
            row = repo.FlowVersionRow(
                org_id=org_id,
                flow_version_id=new_id("fv"),
                flow_api_name=info.api_name,
                version_number=info.version,
                source_json=source_json,
                metadata_digest=info.metadata_digest,
                label=label or info.label or info.api_name,
                created_at=await db_now(conn),
            )
            if await repo.insert_flow_version_txn(conn, row):
                return row
            existing = await repo.get_flow_version_by_number_txn(
                conn, org_id, info.api_name, info.version
            )
            if existing is None:  # the duplicate was on another key: a fresh id collided
                raise ConflictError("Flow version id collision; retry", entity="FlowVersion")
            if existing.metadata_digest != info.metadata_digest:
                raise FlowVersionConflictError(
                    info.api_name, info.version, existing.metadata_digest, info.metadata_digest
                )
            return existing

        return await self._txn(txn)

    async def _flow_version(self, org_id: str, flow_version_id: str) -> repo.FlowVersionRow:
        if not flow_version_id:
            raise InvalidArgumentError("flow_version_id is required", field_path="flow_version_id")

        async def read(conn: AsyncConnection) -> repo.FlowVersionRow | None:
            return await repo.get_flow_version_txn(conn, org_id, flow_version_id)

        row = await self._read(read)
        if row is None:
            raise NotFoundError("FlowVersion", flow_version_id)
        return row

    async def list_flow_versions(
        self,
        org_id: str,
        flow_api_name: str,
        page_size: int,
        page_token: str,
        *,
        app_installation_id: str | None = None,
        runtime_capability_id: str | None = None,
    ) -> tuple[list[repo.FlowVersionRow], list[repo.ActivationRow], str]:
        """One page of Flow versions, the active activations of their Flows, next token.

        Activations are those of the caller's installation/capability when its credential
        carries them: another installation's plans are never disclosed (§10.0).
        """
        size = clamp_page_size(page_size, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        filters = {"flow_api_name": flow_api_name}
        token = decode_token(page_token, filters)
        after = None if token is None else (str(token["a"][0]), int(token["a"][1]))

        async def read(
            conn: AsyncConnection,
        ) -> tuple[list[repo.FlowVersionRow], list[repo.ActivationRow]]:
            rows = await repo.list_flow_versions_txn(
                conn, org_id, flow_api_name=flow_api_name or None, after=after, limit=size + 1
            )
            names = sorted({r.flow_api_name for r in rows[:size]})
            acts = await repo.active_activations_txn(
                conn,
                org_id,
                flow_api_names=names,
                app_installation_id=app_installation_id,
                runtime_capability_id=runtime_capability_id,
            )
            return rows, acts

        rows, acts = await self._read(read)
        next_token = ""
        if len(rows) > size:
            rows = rows[:size]
            last = rows[-1]
            next_token = encode_token(
                {"f": filters, "a": [last.flow_api_name, last.version_number]}
            )
        return rows, acts, next_token

    async def compile_flow_version(
        self,
        scope: TrustedRuntimeWorkScope,
        flow_version_id: str,
        catalog_generation_id: str,
        catalog_digest: str,
        requested_profile: ExecutionProfile | None = None,
    ) -> CompileOutcome:
        """Compile against one sealed generation; store the plan only when it is valid.

        Raises:
            NotFoundError: unknown Flow version (in the org) or catalog generation (in the
                scope).
            FailedPreconditionError: the generation is not sealed or its view is missing.
        """
        if not catalog_generation_id or not catalog_digest:
            raise InvalidArgumentError(
                "catalog_generation_id and catalog_digest are required",
                field_path="catalog_digest" if catalog_generation_id else "catalog_generation_id",
            )
        flow = await self._flow_version(scope.org_id, flow_version_id)
        snapshot = await self._catalog.load_snapshot(scope, catalog_generation_id, catalog_digest)
        policy = await self.policies.current(scope.org_id)
        outcome, _, _ = await self.compiler.compile(flow, snapshot, policy)
        if isinstance(outcome, PlanCompileError):
            return CompileOutcome(False, None, diagnostics_of(outcome))
        if requested_profile is not None and outcome.profile is not requested_profile:
            refusal = await self._profile_refusal(
                flow, snapshot, policy, outcome, requested_profile
            )
            return CompileOutcome(False, None, refusal)
        self.compiler.check_scope(outcome, scope)
        row = await self.compiler.store(flow, outcome)
        return CompileOutcome(True, row, diagnostics_of(outcome))

    async def _profile_refusal(
        self,
        flow: repo.FlowVersionRow,
        snapshot: CatalogSnapshot,
        policy: PolicyGeneration,
        plan: ExecutionPlan,
        requested: ExecutionProfile,
    ) -> tuple[DiagnosticValue, ...]:
        """Diagnostics of an explicit profile request the compiler did not select.

        For Bounded Atomic the request is proven the way ``run_atomically`` is (§9.2), so
        the diagnostics name the exact transitive blockers; no plan is stored either way.
        """
        head = DiagnosticValue(
            "error",
            "flow",
            "profile.requested_unproven",
            f"requested profile {requested.value} cannot be proven; the compiler selected "
            f"{plan.profile.value}",
        )
        if requested is ExecutionProfile.BOUNDED_ATOMIC:
            outcome, _, _ = await self.compiler.compile(flow, snapshot, policy, run_atomically=True)
            if isinstance(outcome, PlanCompileError):
                return (head, *diagnostics_of(outcome))
        return (head,)

    async def get_plan(
        self,
        org_id: str,
        plan_ref: str,
        *,
        visible_to: Mapping[str, str | None] | None = None,
    ) -> PlanView:
        """A plan of ``org_id`` by plan id or plan digest; NOT_FOUND in any other org.

        ``visible_to`` (the scope components a caller's credential carries, ``None`` for
        a component it does not carry) hides a plan of another installation, capability
        or binding exactly like a missing one (§10.0).
        """
        if not plan_ref:
            raise InvalidArgumentError("plan_id is required", field_path="plan_id")

        async def read(conn: AsyncConnection) -> tuple[repo.PlanRow | None, dict[Any, str]]:
            if is_digest(plan_ref):
                row = await repo.get_plan_by_digest_txn(conn, org_id, plan_ref)
            else:
                row = await repo.get_plan_txn(conn, org_id, plan_ref)
            ids: dict[Any, str] = {}
            if row is not None:
                for pin in row.plan().subflows:
                    fv = await repo.get_flow_version_by_number_txn(
                        conn, org_id, pin.api_name, pin.version
                    )
                    if fv is not None:
                        ids[(pin.api_name, pin.version)] = fv.flow_version_id
            return row, ids

        row, ids = await self._read(read)
        if row is None or not _visible(row, visible_to):
            raise NotFoundError("FlowExecutionPlan", plan_ref)
        return PlanView(row, row.plan(), ids)

    async def inventory(
        self,
        scope: TrustedRuntimeWorkScope,
        catalog_generation_id: str,
        catalog_digest: str,
        flow_api_names: Sequence[str],
        page_size: int,
        page_token: str,
    ) -> tuple[list[InventoryRow], str]:
        """Compile every active Flow (or the named ones) without storing or changing anything.

        Named Flows without an active version report their newest registered version.
        """
        size = clamp_page_size(page_size, DEFAULT_PAGE_SIZE, MAX_INVENTORY_PAGE)
        names_filter = sorted(set(flow_api_names))
        filters = {
            "names": names_filter,
            "generation": catalog_generation_id,
            "digest": catalog_digest,
        }
        token = decode_token(page_token, filters)
        after = None if token is None else str(token["a"])

        async def read(conn: AsyncConnection) -> list[repo.FlowVersionRow]:
            acts = await repo.active_activations_txn(
                conn,
                scope.org_id,
                flow_api_names=names_filter or None,
                app_installation_id=scope.app_installation_id,
                runtime_capability_id=scope.runtime_capability_id,
            )
            by_name = {a.flow_api_name: a.flow_version_id for a in acts}
            versions = await repo.get_flow_versions_txn(conn, scope.org_id, by_name.values())
            chosen = {n: versions[v] for n, v in by_name.items() if v in versions}
            missing = [n for n in names_filter if n not in chosen]
            chosen.update(await repo.latest_flow_versions_txn(conn, scope.org_id, missing))
            return [chosen[n] for n in sorted(chosen) if after is None or n > after]

        flows = await self._read(read)
        page, more = flows[:size], len(flows) > size
        if not page:
            return [], ""
        snapshot = await self._catalog.load_snapshot(scope, catalog_generation_id, catalog_digest)
        policy = await self.policies.current(scope.org_id)
        rows = []
        for flow in page:
            outcome, inputs, document = await self.compiler.compile(flow, snapshot, policy)
            rows.append(
                inventory_row(flow.flow_api_name, flow.flow_version_id, document, inputs, outcome)
            )
        next_token = encode_token({"f": filters, "a": page[-1].flow_api_name}) if more else ""
        return rows, next_token

    @staticmethod
    def source_info(flow: repo.FlowVersionRow) -> FlowSourceInfo:
        """The parsed fields of a stored Flow version (it parsed when it was stored)."""
        return parse_source_json(flow.source_json)
