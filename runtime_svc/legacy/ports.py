"""Live ports of the legacy interpreter and the Flow library it walks.

:class:`LivePorts` binds one segment to its transaction: record reads are current reads
on that connection, every record mutation goes through the record engine's composable
``_txn`` functions (validation, its own canonical locks, history sequence, business event
and audit row) in element order — the legacy interpreter never batches a lock plan, which
is the behaviour adopters relied upon (a conflicting order is a deadlock that the
segment's transaction retry absorbs). Pure built-in actions run inline; any other action
fails closed (``unsupported_action``), exactly as the V2 worker does until the
effect-owner and wait protocols land.

:class:`FlowLibrary` loads a Flow version and, transitively, every Subflow version it
calls, from the trusted org's ``flow_versions`` — the element walk needs them
synchronously.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler import FlowDef
from runtime_svc.compiler.diagnostics import IssueSink
from runtime_svc.compiler.parse import parse_flow
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions.source import subflow_refs
from runtime_svc.legacy.interpreter import (
    ActionDone,
    ActionFailed,
    ActionOutcome,
    LegacyFault,
    RecordWrite,
)
from runtime_svc.records import (
    Actor,
    Lineage,
    RecordValidationError,
    RecordView,
    acquire_locks_txn,
    apply_mutation_txn,
    new_record_id,
    plan_mutation,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records.store import query_children_txn, read_record_txn
from runtime_svc.worker.actions import PureActionError, run_pure_action
from services.errors import NotFoundError

__all__ = ["LEGACY_ACTOR", "FlowLibrary", "LivePorts", "record_value"]

#: Audit actor of legacy-interpreter record writes.
LEGACY_ACTOR = Actor(kind="flow", id="legacy-interpreter")
_MAX_SUBFLOWS = 64


def record_value(value: Any) -> Any:
    """A record field value: exact decimals become ``int`` or ``float`` (record number
    fields hold JSON numbers), containers recursively."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, Mapping):
        return {str(k): record_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [record_value(v) for v in value]
    return value


def parse_source(source: Mapping[str, Any]) -> FlowDef:
    """The parsed Flow of a stored (already validated) source.

    Raises:
        LegacyFault: ``flow_source_invalid`` when it does not parse.
    """
    sink = IssueSink()
    flow = parse_flow(source, sink)
    if flow is None or sink.has_errors:
        raise LegacyFault("flow_source_invalid", "the stored Flow version does not parse")
    return flow


class FlowLibrary:
    """A root Flow version plus every Subflow version it reaches (one org)."""

    def __init__(self, root: FlowDef, subflows: Mapping[tuple[str, int], FlowDef]) -> None:
        self.root = root
        self._subflows = dict(subflows)

    def subflow(self, api_name: str, version: int) -> FlowDef | None:
        return self._subflows.get((api_name, version))

    @classmethod
    async def load_txn(
        cls, conn: AsyncConnection, org_id: str, flow_version_id: str
    ) -> FlowLibrary:
        """Load ``flow_version_id`` of ``org_id`` and its subflows (bounded walk).

        Raises:
            NotFoundError: the Flow version is not in the org.
        """
        row = await repo.get_flow_version_txn(conn, org_id, flow_version_id)
        if row is None:
            raise NotFoundError("flow_version", flow_version_id)
        doc = json.loads(row.source_json)
        root = parse_source(doc)
        found: dict[tuple[str, int], FlowDef] = {}
        pending = list(subflow_refs(doc))
        while pending and len(found) < _MAX_SUBFLOWS:
            ref = pending.pop()
            if (ref.api_name, ref.version) in found:
                continue
            child = await repo.get_flow_version_by_number_txn(
                conn, org_id, ref.api_name, ref.version
            )
            if child is None:
                continue  # the walk fails closed with subflow_missing if it gets there
            child_doc = json.loads(child.source_json)
            found[(ref.api_name, ref.version)] = parse_source(child_doc)
            pending.extend(subflow_refs(child_doc))
        return cls(root, found)


class LivePorts:
    """The ports of one live segment (see the module docstring)."""

    def __init__(
        self,
        conn: AsyncConnection,
        org_id: str,
        flow_run_id: str,
        library: FlowLibrary,
        view: RecordView | None,
    ) -> None:
        self._conn = conn
        self._org = org_id
        self._run = flow_run_id
        self._library = library
        self._view = view

    async def read_record(self, object_name: str, record_id: str) -> dict[str, Any] | None:
        state = await read_record_txn(self._conn, self._org, object_name, record_id)
        return None if state is None else {"Id": state.record_id, **dict(state.fields)}

    async def query_records(
        self, object_name: str, field_name: str, value: Any, limit: int
    ) -> list[dict[str, Any]]:
        view = self._require_view()
        rel = view.indexed_relationship(object_name)
        if rel is None or rel.field != field_name:
            raise LegacyFault(
                "unsupported_element",
                f"GetRecords on {object_name} by {field_name}: only Id or the indexed "
                "parent lookup can be queried",
            )
        found = await query_children_txn(
            self._conn, self._org, object_name, rel.parent_object, field_name, str(value), limit
        )
        return [{"Id": s.record_id, **dict(s.fields)} for s in found]

    def new_record_id(self) -> str:
        return new_record_id()

    def _require_view(self) -> RecordView:
        if self._view is None:
            raise LegacyFault("metadata_view_missing", "no record view for this scope")
        return self._view

    async def write_record(self, write: RecordWrite) -> None:
        view = self._require_view()
        fields = record_value(dict(write.fields))
        current = None
        try:
            if write.kind == "create":
                mutation = prepare_create(view, write.object_name, write.record_id, fields)
            else:
                current = await read_record_txn(
                    self._conn, self._org, write.object_name, write.record_id
                )
                if current is None:
                    raise LegacyFault(
                        "record_not_found",
                        f"{write.object_name} {write.record_id} not found",
                        routable=True,
                    )
                if write.kind == "update":
                    mutation = prepare_update(
                        view, write.object_name, write.record_id, None, fields
                    )
                else:
                    mutation = prepare_delete(view, write.object_name, write.record_id, None)
            plan = plan_mutation(view, mutation, current)
            locks = await acquire_locks_txn(self._conn, self._org, view, plan, [mutation])
            await apply_mutation_txn(
                self._conn,
                self._org,
                view,
                mutation,
                locks,
                actor=LEGACY_ACTOR,
                lineage=Lineage(flow_run_id=self._run),
            )
        except RecordValidationError as exc:
            raise LegacyFault("record_invalid", str(exc), routable=True) from exc
        except NotFoundError as exc:
            raise LegacyFault("record_not_found", str(exc), routable=True) from exc

    async def call_action(
        self, element: str, action_type: str, inputs: Mapping[str, Any]
    ) -> ActionOutcome:
        try:
            return ActionDone(run_pure_action(action_type, inputs))
        except KeyError:
            raise LegacyFault(
                "unsupported_action", f"action {action_type!r} has no inline handler"
            ) from None
        except PureActionError:
            return ActionFailed("action_failed")

    def subflow(self, api_name: str, version: int) -> FlowDef | None:
        return self._library.subflow(api_name, version)
