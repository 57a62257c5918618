"""``flowctl record …``: create, update, read and delete business records (RecordService).

::

    flowctl record create OBJECT (--field NAME=VALUE … | --fields JSON) [--id ID]
                          [--parent RELATIONSHIP=OBJECT:ID …]
    flowctl record update OBJECT ID --expected-version V (--field NAME=VALUE … | --fields JSON)
    flowctl record get OBJECT ID
    flowctl record delete OBJECT ID --expected-version V

A record write runs the before-save Flows its scope subscribes inside the record
transaction and admits the after-save runs; the output lists the runs it started
(``flowctl run watch RUN_ID`` follows one). ``--field`` values are JSON when they parse
as JSON (``3``, ``true``, ``null``, ``"007"``) and plain strings otherwise; ``--fields``
takes one JSON object. Writes need the complete work scope (flags, or ``make run``'s
``demo.json``); ``update`` and ``delete`` are compare-and-swap on ``--expected-version``
(the ``version`` ``get`` prints), a stale one fails ``ABORTED``.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct

from flowctl.common import UsageError, add_connection_args, call_metadata, channel_for, work_scope
from flowctl.output import add_output_args, fields, message_json, print_json, timestamp_text
from services.config import ServiceName
from services.proto import runtime_v1

__all__ = ["parse_fields", "record_text", "register"]

_CALL_TIMEOUT_S = 30.0


def _stub(channel: grpc.Channel) -> Any:
    return runtime_v1.RecordServiceStub(channel)


def parse_fields(pairs: Sequence[str], document: str) -> Struct:
    """``--field NAME=VALUE`` pairs and/or one ``--fields`` JSON object as a ``Struct``.

    Raises:
        UsageError: a pair without ``=``, a non-object ``--fields`` or no field at all.
    """
    values: dict[str, Any] = {}
    if document:
        try:
            doc = json.loads(document)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--fields is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise UsageError("--fields must be a JSON object")
        values.update(doc)
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--field needs NAME=VALUE, got {pair!r}")
        try:
            values[name] = json.loads(raw)
        except json.JSONDecodeError:
            values[name] = raw
    if not values:
        raise UsageError("give the record's fields with --field NAME=VALUE or --fields JSON")
    struct = Struct()
    struct.update(values)
    return struct


def _parents(specs: Sequence[str]) -> list[runtime_v1.ParentRef]:
    refs = []
    for spec in specs:
        relationship, sep, target = spec.partition("=")
        obj, sep2, record_id = target.partition(":")
        if not (sep and sep2 and relationship and obj and record_id):
            raise UsageError(f"--parent needs RELATIONSHIP=OBJECT:ID, got {spec!r}")
        refs.append(
            runtime_v1.ParentRef(
                relationship_name=relationship,
                parent_object_api_name=obj,
                parent_record_id=record_id,
            )
        )
    return refs


def record_text(record: runtime_v1.Record, triggered: Sequence[str] = ()) -> str:
    """A record as ``key: value`` lines, its fields indented below."""
    head = fields(
        (
            ("record", f"{record.object_api_name} {record.record_id}"),
            ("version", record.version),
            ("deleted", "yes" if record.is_deleted else "no"),
            ("created", timestamp_text(record.created_at)),
            ("updated", timestamp_text(record.updated_at)),
        )
    )
    values = message_json(record.fields) if record.HasField("fields") else {}
    body = "fields:\n" + (
        "".join(f"  {k} = {json.dumps(v, ensure_ascii=False)}\n" for k, v in sorted(values.items()))
        or "  (none)\n"
    )
    parents = "".join(
        f"parent: {p.relationship_name} -> {p.parent_object_api_name} {p.parent_record_id}\n"
        for p in record.parent_refs
    )
    runs = "".join(f"started run: {r}\n" for r in triggered)
    return head + body + parents + runs


def _print(args: argparse.Namespace, resp: Any, triggered: bool = True) -> int:
    if args.json:
        print_json(resp)
    else:
        ids = list(resp.triggered_flow_run_ids) if triggered else []
        sys.stdout.write(record_text(resp.record, ids))
    return 0


def _create(args: argparse.Namespace) -> int:
    values = parse_fields(args.field or [], args.fields)  # local checks before the scope
    request = runtime_v1.CreateRecordRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        scope=work_scope(args, "record create"),
        object_api_name=args.object,
        record_id=args.id or "",
        fields=values,
        parent_refs=_parents(args.parent or []),
    )
    with channel_for(args.target) as channel:
        resp = _stub(channel).CreateRecord(
            request, metadata=call_metadata(args, ServiceName.RUNTIME), timeout=_CALL_TIMEOUT_S
        )
    return _print(args, resp)


def _update(args: argparse.Namespace) -> int:
    values = parse_fields(args.field or [], args.fields)
    request = runtime_v1.UpdateRecordRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        scope=work_scope(args, "record update"),
        object_api_name=args.object,
        record_id=args.record_id,
        expected_version=args.expected_version,
        fields=values,
    )
    with channel_for(args.target) as channel:
        resp = _stub(channel).UpdateRecord(
            request, metadata=call_metadata(args, ServiceName.RUNTIME), timeout=_CALL_TIMEOUT_S
        )
    return _print(args, resp)


def _delete(args: argparse.Namespace) -> int:
    request = runtime_v1.DeleteRecordRequest(
        request_id=args.request_id or uuid.uuid4().hex,
        scope=work_scope(args, "record delete"),
        object_api_name=args.object,
        record_id=args.record_id,
        expected_version=args.expected_version,
    )
    with channel_for(args.target) as channel:
        resp = _stub(channel).DeleteRecord(
            request, metadata=call_metadata(args, ServiceName.RUNTIME), timeout=_CALL_TIMEOUT_S
        )
    return _print(args, resp)


def _get(args: argparse.Namespace) -> int:
    with channel_for(args.target) as channel:
        resp = _stub(channel).GetRecord(
            runtime_v1.GetRecordRequest(
                org_id=args.org, object_api_name=args.object, record_id=args.record_id
            ),
            metadata=call_metadata(args, ServiceName.RUNTIME),
            timeout=_CALL_TIMEOUT_S,
        )
    return _print(args, resp, triggered=False)


def register(groups: Any) -> None:
    """Add the ``record`` command group."""
    record = groups.add_parser("record", help="create, update, read and delete records")
    commands = record.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, func: Any, *, record_id: bool = True) -> Any:
        p = commands.add_parser(name, help=help_text)
        p.add_argument("object", metavar="OBJECT", help="object API name, e.g. Contact")
        if record_id:
            p.add_argument("record_id", metavar="ID", help="record id")
        add_connection_args(p, ServiceName.RUNTIME)
        add_output_args(p)
        p.set_defaults(func=func)
        return p

    def field_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--field", action="append", metavar="NAME=VALUE", help="a field value (repeatable)"
        )
        p.add_argument("--fields", default="", metavar="JSON", help="field values as JSON")
        p.add_argument("--request-id", default="", help="idempotency token of this call")

    create = command(
        "create", "create a record (runs before/after-save Flows)", _create, record_id=False
    )
    field_args(create)
    create.add_argument("--id", default="", help="record id (server-generated when left out)")
    create.add_argument(
        "--parent", action="append", metavar="REL=OBJECT:ID", help="parent reference (repeatable)"
    )

    update = command("update", "update a record at its current version", _update)
    field_args(update)
    update.add_argument(
        "--expected-version", type=int, required=True, help="the record's current version"
    )

    delete = command("delete", "soft-delete a record at its current version", _delete)
    delete.add_argument(
        "--expected-version", type=int, required=True, help="the record's current version"
    )
    delete.add_argument("--request-id", default="", help="idempotency token of this call")

    command("get", "read a record", _get)
