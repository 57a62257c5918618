"""Storage of Flow versions, runtime policies, execution plans and activation bindings.

Every function is a ``_txn`` helper: it runs inside the caller's transaction
(``services.db.transaction``/``run_in_transaction``) and takes the trusted org (or the
complete trusted work scope) first — there is no ID-only lookup (§10.0). The rules of
ARCHITECTURE §2 apply: insert-if-absent on a unique key, fences as conditional UPDATEs
checked by row count (``cas_update``), no ``RETURNING``, no AUTO_INCREMENT ordering.

Plans have no update helper at all: an ``execution_plans`` row is written once by
:func:`insert_plan_txn` and then only read (§7.4 "no update of plan payload").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, bindparam, func, or_, select
from sqlalchemy.engine import Dialect, RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler import ExecutionPlan
from runtime_svc.definitions.policy import PolicyGeneration
from runtime_svc.schema import (
    execution_plans,
    flow_runs,
    flow_versions,
    plan_activations,
    runtime_policies,
)
from services.auth import TrustedRuntimeWorkScope
from services.db import cas_update, insert_if_absent
from services.digest import canonical_json

__all__ = [
    "ACTIVE",
    "BLOCKED",
    "DEACTIVATED",
    "SUPERSEDED",
    "TERMINAL_RUN_STATES",
    "ActivationRow",
    "FlowVersionRow",
    "PlanRow",
    "active_activation_txn",
    "active_activations_txn",
    "active_plan_ids_column",
    "active_plan_ids_params",
    "active_plan_ids_txn",
    "end_activation_txn",
    "get_activation_txn",
    "get_flow_version_by_number_txn",
    "get_flow_version_txn",
    "get_flow_versions_txn",
    "get_plan_by_digest_txn",
    "get_plan_by_identity_txn",
    "get_plan_txn",
    "has_live_runs_txn",
    "insert_activation_txn",
    "insert_flow_version_txn",
    "insert_plan_txn",
    "insert_policy_txn",
    "latest_activation_for_version_txn",
    "latest_flow_versions_txn",
    "latest_policy_txn",
    "list_flow_versions_txn",
    "parse_active_plan_ids",
    "plan_row_values",
    "to_json",
]

#: Activation states (``plan_activations.state``).
ACTIVE, SUPERSEDED, DEACTIVATED, BLOCKED = "ACTIVE", "SUPERSEDED", "DEACTIVATED", "BLOCKED"
#: FlowRun states after which a run no longer needs its plan's catalog artifacts
#: (§11.1; ``Quarantined`` still needs them for reconciliation).
TERMINAL_RUN_STATES = ("Succeeded", "TerminalFailed", "Cancelled")


def to_json(value: Any) -> str:
    """Canonical JSON text for a ``JsonText`` column."""
    return canonical_json(value).decode("utf-8")


# --- rows --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowVersionRow:
    """One immutable Flow version."""

    org_id: str
    flow_version_id: str
    flow_api_name: str
    version_number: int
    source_json: str
    metadata_digest: str
    label: str | None
    created_at: datetime

    @classmethod
    def from_row(cls, r: RowMapping) -> FlowVersionRow:
        return cls(
            r["org_id"],
            r["flow_version_id"],
            r["flow_id"],
            int(r["version_number"]),
            r["source_payload"],
            r["metadata_digest"],
            r["label"],
            r["created_at"],
        )


@dataclass(frozen=True)
class PlanRow:
    """One immutable execution plan row (§7.4)."""

    scope: TrustedRuntimeWorkScope
    plan_id: str
    flow_version_id: str
    metadata_digest: str
    compiler_version: str
    catalog_generation_id: str
    catalog_digest: str
    catalog_revision: int
    schema_generation: int
    engine_generation: int
    catalog_snapshot_digest: str
    metadata_view_digest: str
    trigger_binding_digest: str
    policy_version: int
    execution_profile: str
    plan_digest: str
    plan_payload: str
    bound_summary: str
    diagnostic_summary: str
    created_at: datetime

    @classmethod
    def from_row(cls, r: RowMapping) -> PlanRow:
        return cls(
            scope=_scope(r),
            plan_id=r["plan_id"],
            flow_version_id=r["flow_version_id"],
            metadata_digest=r["metadata_digest"],
            compiler_version=r["compiler_version"],
            catalog_generation_id=r["catalog_generation_id"],
            catalog_digest=r["catalog_digest"],
            catalog_revision=int(r["catalog_revision"]),
            schema_generation=int(r["schema_generation"]),
            engine_generation=int(r["engine_generation"]),
            catalog_snapshot_digest=r["catalog_snapshot_digest"],
            metadata_view_digest=r["runtime_metadata_view_digest"],
            trigger_binding_digest=r["trigger_binding_digest"],
            policy_version=int(r["policy_version"]),
            execution_profile=r["execution_profile"],
            plan_digest=r["plan_digest"],
            plan_payload=r["plan_payload"],
            bound_summary=r["bound_summary"],
            diagnostic_summary=r["diagnostic_summary"],
            created_at=r["created_at"],
        )

    @property
    def org_id(self) -> str:
        return self.scope.org_id

    def plan(self) -> ExecutionPlan:
        """The stored plan value (check it with ``ExecutionPlan.verify``)."""
        return ExecutionPlan.from_dict(json.loads(self.plan_payload))


@dataclass(frozen=True)
class ActivationRow:
    """One activation binding or blocked activation attempt."""

    scope: TrustedRuntimeWorkScope
    activation_id: str
    flow_version_id: str
    flow_api_name: str
    trigger_binding_digest: str
    plan_id: str | None
    plan_digest: str | None
    state: str
    attempt_diagnostics: str | None
    state_version: int
    created_at: datetime
    activated_at: datetime | None
    ended_at: datetime | None

    @classmethod
    def from_row(cls, r: RowMapping) -> ActivationRow:
        return cls(
            scope=_scope(r),
            activation_id=r["activation_id"],
            flow_version_id=r["flow_version_id"],
            flow_api_name=r["flow_api_name"],
            trigger_binding_digest=r["trigger_binding_digest"],
            plan_id=r["plan_id"],
            plan_digest=r["plan_digest"],
            state=r["state"],
            attempt_diagnostics=r["attempt_diagnostics"],
            state_version=int(r["state_version"]),
            created_at=r["created_at"],
            activated_at=r["activated_at"],
            ended_at=r["superseded_at"],
        )


def _scope(r: RowMapping) -> TrustedRuntimeWorkScope:
    return TrustedRuntimeWorkScope(
        r["org_id"],
        r["app_installation_id"],
        r["runtime_capability_id"],
        r["runtime_work_binding_digest"],
    )


# --- Flow versions -------------------------------------------------------------------------


async def insert_flow_version_txn(conn: AsyncConnection, row: FlowVersionRow) -> bool:
    """Insert a Flow version; ``False`` when its (org, API name, version) already exists."""
    return await insert_if_absent(
        conn,
        flow_versions,
        {
            "org_id": row.org_id,
            "flow_version_id": row.flow_version_id,
            "flow_id": row.flow_api_name,
            "version_number": row.version_number,
            "source_payload": row.source_json,
            "metadata_digest": row.metadata_digest,
            "label": row.label,
            "created_at": row.created_at,
        },
    )


async def get_flow_version_txn(
    conn: AsyncConnection, org_id: str, flow_version_id: str
) -> FlowVersionRow | None:
    """The Flow version ``flow_version_id`` of ``org_id``, or ``None``."""
    t = flow_versions.c
    row = (
        (
            await conn.execute(
                select(flow_versions).where(
                    t.org_id == org_id, t.flow_version_id == flow_version_id
                )
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else FlowVersionRow.from_row(row)


async def get_flow_versions_txn(
    conn: AsyncConnection, org_id: str, flow_version_ids: Iterable[str]
) -> dict[str, FlowVersionRow]:
    """Flow versions by id (missing ids are absent from the result)."""
    ids = sorted(set(flow_version_ids))
    if not ids:
        return {}
    t = flow_versions.c
    rows = (
        await conn.execute(
            select(flow_versions).where(t.org_id == org_id, t.flow_version_id.in_(ids))
        )
    ).mappings()
    return {r["flow_version_id"]: FlowVersionRow.from_row(r) for r in rows}


async def get_flow_version_by_number_txn(
    conn: AsyncConnection, org_id: str, flow_api_name: str, version_number: int
) -> FlowVersionRow | None:
    """The Flow version ``flow_api_name@version_number`` of ``org_id``, or ``None``."""
    t = flow_versions.c
    row = (
        (
            await conn.execute(
                select(flow_versions).where(
                    t.org_id == org_id,
                    t.flow_id == flow_api_name,
                    t.version_number == version_number,
                )
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else FlowVersionRow.from_row(row)


async def list_flow_versions_txn(
    conn: AsyncConnection,
    org_id: str,
    *,
    flow_api_name: str | None,
    after: tuple[str, int] | None,
    limit: int,
) -> list[FlowVersionRow]:
    """Flow versions by API name, then version number (keyset pagination after ``after``)."""
    t = flow_versions.c
    q = select(flow_versions).where(t.org_id == org_id)
    if flow_api_name:
        q = q.where(t.flow_id == flow_api_name)
    if after is not None:
        q = q.where(
            or_(t.flow_id > after[0], and_(t.flow_id == after[0], t.version_number > after[1]))
        )
    q = q.order_by(t.flow_id, t.version_number).limit(limit)
    return [FlowVersionRow.from_row(r) for r in (await conn.execute(q)).mappings()]


async def latest_flow_versions_txn(
    conn: AsyncConnection, org_id: str, flow_api_names: Sequence[str]
) -> dict[str, FlowVersionRow]:
    """The highest registered version of each named Flow."""
    if not flow_api_names:
        return {}
    t = flow_versions.c
    top = (
        select(t.flow_id, func.max(t.version_number).label("v"))
        .where(t.org_id == org_id, t.flow_id.in_(sorted(set(flow_api_names))))
        .group_by(t.flow_id)
        .subquery()
    )
    q = (
        select(flow_versions)
        .join(top, and_(t.flow_id == top.c.flow_id, t.version_number == top.c.v))
        .where(t.org_id == org_id)
    )
    return {r["flow_id"]: FlowVersionRow.from_row(r) for r in (await conn.execute(q)).mappings()}


# --- policies --------------------------------------------------------------------------------


async def latest_policy_txn(conn: AsyncConnection, org_id: str) -> PolicyGeneration | None:
    """The newest policy generation of ``org_id``, or ``None`` before first use."""
    t = runtime_policies.c
    row = (
        (
            await conn.execute(
                select(runtime_policies)
                .where(t.org_id == org_id)
                .order_by(t.policy_version.desc())
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        return None
    return PolicyGeneration(
        org_id, int(row["policy_version"]), json.loads(row["policy_payload"]), row["policy_digest"]
    )


async def insert_policy_txn(
    conn: AsyncConnection, generation: PolicyGeneration, now: datetime
) -> bool:
    """Insert a policy generation; ``False`` when that version number is taken."""
    return await insert_if_absent(
        conn,
        runtime_policies,
        {
            "org_id": generation.org_id,
            "policy_version": generation.version,
            "policy_payload": to_json(generation.document),
            "policy_digest": generation.document_digest,
            "created_at": now,
        },
    )


# --- plans -------------------------------------------------------------------------------------


def plan_row_values(
    plan: ExecutionPlan,
    *,
    plan_id: str,
    flow_version_id: str,
    created_at: Any,
    diagnostic_summary: str = "[]",
) -> dict[str, Any]:
    """The ``execution_plans`` row of a compiled plan: its work scope, identity tuple,
    digests and canonical payload (the one mapping every writer of plan rows uses)."""
    b = plan.binding
    return {
        "org_id": b.org_id,
        "app_installation_id": b.app_installation_id,
        "runtime_capability_id": b.runtime_capability_id,
        "runtime_work_binding_digest": b.binding_digest,
        "plan_id": plan_id,
        "flow_version_id": flow_version_id,
        "metadata_digest": plan.flow.metadata_digest,
        "compiler_version": plan.compiler_version,
        "catalog_generation_id": plan.catalog.generation_id,
        "catalog_digest": plan.catalog.catalog_digest,
        "catalog_revision": b.catalog_revision,
        "schema_generation": b.schema_generation,
        "engine_generation": b.engine_generation,
        "catalog_snapshot_digest": b.catalog_snapshot_digest,
        "runtime_metadata_view_digest": b.metadata_view_digest,
        "trigger_binding_digest": plan.trigger_binding_digest,
        "policy_version": plan.policy_version,
        "execution_profile": plan.profile.value,
        "plan_digest": plan.plan_digest,
        "plan_payload": to_json(plan.to_dict()),
        "bound_summary": to_json(plan.bounds.to_dict()),
        "diagnostic_summary": diagnostic_summary,
        "created_at": created_at,
    }


async def insert_plan_txn(conn: AsyncConnection, values: Mapping[str, Any]) -> bool:
    """Insert an immutable plan row; ``False`` when its identity tuple (or id) exists."""
    return await insert_if_absent(conn, execution_plans, values)


def _plan_query() -> Any:
    return select(execution_plans)


async def get_plan_txn(conn: AsyncConnection, org_id: str, plan_id: str) -> PlanRow | None:
    """The plan ``plan_id`` of ``org_id``, or ``None``."""
    t = execution_plans.c
    row = (
        (await conn.execute(_plan_query().where(t.org_id == org_id, t.plan_id == plan_id)))
        .mappings()
        .first()
    )
    return None if row is None else PlanRow.from_row(row)


async def get_plan_by_digest_txn(
    conn: AsyncConnection, org_id: str, plan_digest: str
) -> PlanRow | None:
    """The plan with ``plan_digest`` in ``org_id``, or ``None``."""
    t = execution_plans.c
    row = (
        (
            await conn.execute(
                _plan_query()
                .where(t.org_id == org_id, t.plan_digest == plan_digest)
                .order_by(t.plan_id)
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else PlanRow.from_row(row)


async def get_plan_by_identity_txn(
    conn: AsyncConnection, identity: Mapping[str, Any]
) -> PlanRow | None:
    """The plan with the unique identity tuple ``identity`` (column → value)."""
    t = execution_plans.c
    row = (
        (await conn.execute(_plan_query().where(*(t[k] == v for k, v in identity.items()))))
        .mappings()
        .first()
    )
    return None if row is None else PlanRow.from_row(row)


async def has_live_runs_txn(conn: AsyncConnection, org_id: str, plan_id: str) -> bool:
    """True while any non-terminal run of ``org_id`` is bound to ``plan_id``."""
    t = flow_runs.c
    row = (
        await conn.execute(
            select(t.flow_run_id)
            .where(
                t.org_id == org_id,
                t.plan_id == plan_id,
                t.runtime_state.not_in(TERMINAL_RUN_STATES),
            )
            .limit(1)
        )
    ).first()
    return row is not None


# --- activations -------------------------------------------------------------------------------


def _activation_query() -> Any:
    a, p = plan_activations, execution_plans
    return select(a, p.c.plan_digest).select_from(
        a.outerjoin(p, and_(p.c.org_id == a.c.org_id, p.c.plan_id == a.c.plan_id))
    )


async def active_activation_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_api_name: str,
    app_installation_id: str,
    runtime_capability_id: str,
    *,
    for_update: bool = False,
) -> ActivationRow | None:
    """The ACTIVE activation of a Flow in an installation/capability, or ``None``."""
    a = plan_activations.c
    q = _activation_query().where(
        a.org_id == org_id,
        a.flow_api_name == flow_api_name,
        a.app_installation_id == app_installation_id,
        a.runtime_capability_id == runtime_capability_id,
        a.active_slot == 1,
    )
    if for_update:
        q = q.with_for_update()
    row = (await conn.execute(q)).mappings().first()
    return None if row is None else ActivationRow.from_row(row)


async def active_activations_txn(
    conn: AsyncConnection,
    org_id: str,
    *,
    flow_api_names: Sequence[str] | None = None,
    flow_version_ids: Sequence[str] | None = None,
    app_installation_id: str | None = None,
    runtime_capability_id: str | None = None,
) -> list[ActivationRow]:
    """ACTIVE activations of ``org_id``, filtered, ordered by Flow API name."""
    a = plan_activations.c
    q = _activation_query().where(a.org_id == org_id, a.active_slot == 1)
    if flow_api_names is not None:
        q = q.where(a.flow_api_name.in_(sorted(set(flow_api_names))))
    if flow_version_ids is not None:
        q = q.where(a.flow_version_id.in_(sorted(set(flow_version_ids))))
    if app_installation_id is not None:
        q = q.where(a.app_installation_id == app_installation_id)
    if runtime_capability_id is not None:
        q = q.where(a.runtime_capability_id == runtime_capability_id)
    q = q.order_by(a.flow_api_name, a.app_installation_id, a.runtime_capability_id)
    return [ActivationRow.from_row(r) for r in (await conn.execute(q)).mappings()]


#: The hot-path activation read of trigger admission, as driver SQL per paramstyle and
#: name count: it runs once per record write with a before-save subscription, where
#: SQLAlchemy's statement compilation and cache-key work would be a measurable share
#: of the write. Same predicate as :func:`active_activations_txn` (the unique key
#: ``(org, installation, capability, flow, active_slot)``).
_ACTIVE_PLAN_IDS_SQL: dict[tuple[str, int], str] = {}


def _active_plan_ids_sql(paramstyle: str, count: int) -> str:
    key = (paramstyle, count)
    sql = _ACTIVE_PLAN_IDS_SQL.get(key)
    if sql is None:
        mark = "?" if paramstyle == "qmark" else "%s"
        names = ", ".join([mark] * count)
        # Only placeholders are interpolated (the values are bound parameters).
        sql = (
            "SELECT flow_api_name, flow_version_id, plan_id FROM plan_activations"  # noqa: S608
            f" WHERE org_id = {mark} AND app_installation_id = {mark}"
            f" AND runtime_capability_id = {mark} AND flow_api_name IN ({names})"
            " AND active_slot = 1 ORDER BY flow_api_name"
        )
        _ACTIVE_PLAN_IDS_SQL[key] = sql
    return sql


async def active_plan_ids_txn(
    conn: AsyncConnection,
    org_id: str,
    app_installation_id: str,
    runtime_capability_id: str,
    flow_api_names: Sequence[str],
) -> list[tuple[str, str, str | None]]:
    """``(flow API name, flow version id, plan id)`` of the ACTIVE activations of the
    named Flows in one installation/capability, by Flow name (a lean read for the
    per-write trigger admission; plan and version rows are immutable and cached)."""
    names = sorted(set(flow_api_names))
    if not names:
        return []
    paramstyle = conn.dialect.paramstyle
    if paramstyle not in ("qmark", "format"):
        raise ValueError(f"unsupported driver paramstyle {paramstyle!r}")
    result = await conn.exec_driver_sql(
        _active_plan_ids_sql(paramstyle, len(names)),
        (org_id, app_installation_id, runtime_capability_id, *names),
    )
    out: list[tuple[str, str, str | None]] = []
    for row in result:
        name, version_id, plan_id = tuple(row)
        out.append((str(name), str(version_id), None if plan_id is None else str(plan_id)))
    return out


def active_plan_ids_column(dialect: Dialect, names: int) -> ColumnElement[Any]:
    """:func:`active_plan_ids_txn`'s read as one scalar column — a JSON array of
    ``[flow API name, flow version id, plan id]`` — that another statement of the same
    transaction selects alongside its own (the record write's ledger lookup,
    ``services.request_dedupe.LookupColumn``). Same predicate as
    :func:`active_plan_ids_txn`, for ``names`` distinct Flow names; the values are bound
    parameters (:func:`active_plan_ids_params`) — one per name, not an expanding ``IN``,
    which SQLAlchemy would render again at every execution — so the statement that
    carries it is built once per dialect and number of names and hits SQLAlchemy's
    compiled cache. Decode with :func:`parse_active_plan_ids`.

    Raises:
        ValueError: ``names`` < 1.
    """
    if names < 1:
        raise ValueError("an activation read names at least one Flow")
    a = plan_activations.c
    triple = func.json_array(a.flow_api_name, a.flow_version_id, a.plan_id)
    rows = func.json_group_array(triple) if dialect.name == "sqlite" else func.json_arrayagg(triple)
    return (
        select(rows)
        .where(
            a.org_id == bindparam("ap_org"),
            a.app_installation_id == bindparam("ap_installation"),
            a.runtime_capability_id == bindparam("ap_capability"),
            a.flow_api_name.in_([bindparam(f"ap_name_{i}") for i in range(names)]),
            a.active_slot == 1,
        )
        .scalar_subquery()
        .label("active_plan_ids")
    )


def active_plan_ids_params(
    org_id: str,
    app_installation_id: str,
    runtime_capability_id: str,
    flow_api_names: Sequence[str],
) -> dict[str, Any]:
    """The bound values of :func:`active_plan_ids_column` (built for
    ``len(set(flow_api_names))`` names)."""
    params: dict[str, Any] = {
        "ap_org": org_id,
        "ap_installation": app_installation_id,
        "ap_capability": runtime_capability_id,
    }
    for i, name in enumerate(sorted(set(flow_api_names))):
        params[f"ap_name_{i}"] = name
    return params


def parse_active_plan_ids(value: Any) -> list[tuple[str, str, str | None]]:
    """What :func:`active_plan_ids_column` read, as :func:`active_plan_ids_txn` returns it
    (by Flow name; no active activation: ``[]`` — MariaDB aggregates no row to NULL).

    Raises:
        ValueError: the value is not the column's JSON array of triples.
    """
    if value is None:
        return []
    if isinstance(value, str | bytes):
        # Every before-save write of an object reads the same few values: decoded once.
        return list(_parsed_active_plan_ids(value))
    return _active_plan_ids(value)


@functools.lru_cache(maxsize=256)
def _parsed_active_plan_ids(raw: str | bytes) -> tuple[tuple[str, str, str | None], ...]:
    return tuple(_active_plan_ids(json.loads(raw)))


def _active_plan_ids(items: Any) -> list[tuple[str, str, str | None]]:
    if not isinstance(items, list):
        raise ValueError("active plan ids: not a JSON array")
    out: list[tuple[str, str, str | None]] = []
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError("active plan ids: not a [name, version, plan] triple")
        name, version_id, plan_id = item
        out.append((str(name), str(version_id), None if plan_id is None else str(plan_id)))
    out.sort(key=lambda t: t[0])
    return out


async def get_activation_txn(
    conn: AsyncConnection, org_id: str, activation_id: str
) -> ActivationRow | None:
    """The activation ``activation_id`` of ``org_id``, or ``None``."""
    a = plan_activations.c
    row = (
        (
            await conn.execute(
                _activation_query().where(a.org_id == org_id, a.activation_id == activation_id)
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else ActivationRow.from_row(row)


async def latest_activation_for_version_txn(
    conn: AsyncConnection, org_id: str, flow_version_id: str, states: Sequence[str]
) -> ActivationRow | None:
    """The most recently ended/created activation of a version in one of ``states``."""
    a = plan_activations.c
    row = (
        (
            await conn.execute(
                _activation_query()
                .where(
                    a.org_id == org_id,
                    a.flow_version_id == flow_version_id,
                    a.state.in_(list(states)),
                )
                .order_by(a.superseded_at.desc(), a.created_at.desc(), a.activation_id)
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else ActivationRow.from_row(row)


async def insert_activation_txn(conn: AsyncConnection, values: Mapping[str, Any]) -> bool:
    """Insert an activation row; ``False`` on a duplicate id or a taken active slot."""
    return await insert_if_absent(conn, plan_activations, values)


async def end_activation_txn(
    conn: AsyncConnection, current: ActivationRow, state: str, now: datetime
) -> int:
    """Fenced ACTIVE → ``state`` (SUPERSEDED or DEACTIVATED); frees the active slot.

    Raises:
        FenceLostError: another writer changed the row since it was read.
    """
    return await cas_update(
        conn,
        plan_activations,
        org_id=current.scope.org_id,
        key={"activation_id": current.activation_id},
        expected_version=current.state_version,
        values={"state": state, "active_slot": None, "superseded_at": now},
        extra_predicates=[plan_activations.c.active_slot == 1],
    )
