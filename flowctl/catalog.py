"""``flowctl catalog build|show``: build a capability-catalog generation from a file, show one.

``flowctl catalog build FILE [--seal]`` reads a YAML or JSON document (see
``examples/catalog/demo.yaml``)::

    org_id: org-demo                 # optional, else --org
    app_installation_id: inst-demo   # optional, else --app-installation
    runtime_capability_id: cap-flow  # optional, else --capability
    metadata_view: {...}             # optional: published first (RuntimeMetadataView shape)
    binding: {catalog_revision, schema_generation, engine_generation,
              catalog_snapshot_digest, runtime_metadata_view_digest?}
    contract_version: 1              # optional
    entries:                         # catalog entry submissions
      - action_type: core.send_email
        owner: {kind: extension, registration_id: ext:mail}
        descriptor: {...the eleven §8.4 fields...}
        handler_binding: {owner_registration_id, handler_ref,
                          handler_implementation_version | service_release_digest}
        # no handler_binding = a reserved contract-only entry;
        # source: distribution = a handler binding for an action its owner declared
        #   (owner may be omitted; descriptor is the capability the handler asserts)

and calls, in order, PublishMetadataView (when the view is present), RegisterWorkBinding,
OpenGeneration, SubmitEntry for each entry, and SealGeneration (with ``--seal``). The
credentials follow the server's trust rules: the view is published with an
org+installation credential, the binding registered with org+installation+capability,
and the generation calls use the complete work scope that includes the binding digest
the catalog just returned. It prints a JSON summary (binding digest, generation id,
state, catalog digest, every entry digest and binding fingerprint).

``flowctl catalog show --app-installation I --capability C --binding-digest D
--generation G`` prints the generation and, when sealed, its entries.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf import json_format

from catalog_svc.api.capability_mapping import descriptor_to_proto, handler_binding_to_proto
from catalog_svc.api.view_mapping import view_to_proto
from catalog_svc.domain import (
    CapabilityDescriptor,
    CatalogEntrySubmission,
    Diagnostic,
    DomainValidationError,
    HandlerBinding,
    RuntimeMetadataView,
)
from flowctl.common import (
    CliError,
    add_connection_args,
    call_metadata,
    channel_for,
    load_document,
)
from services.config import ServiceName
from services.proto import catalog_v1, common_v1

__all__ = ["BuildPlan", "BuildResult", "build_catalog", "parse_build_document", "register"]

_CALL_TIMEOUT_S = 30.0
_TOP_KEYS = frozenset(
    {
        "org_id",
        "app_installation_id",
        "runtime_capability_id",
        "metadata_view",
        "binding",
        "contract_version",
        "entries",
    }
)
_BINDING_KEYS = frozenset(
    {
        "catalog_revision",
        "schema_generation",
        "engine_generation",
        "catalog_snapshot_digest",
        "runtime_metadata_view_digest",
    }
)
_DISTRIBUTION = "distribution"


@dataclass(frozen=True)
class BuildPlan:
    """A parsed build document: the requests to send, scope left to the caller."""

    org_id: str | None
    app_installation_id: str | None
    runtime_capability_id: str | None
    view: catalog_v1.MetadataView | None
    binding: Mapping[str, Any]
    contract_version: int
    entries: tuple[catalog_v1.SubmitEntryRequest, ...]


@dataclass(frozen=True)
class BuildResult:
    """What a build produced."""

    binding_digest: str
    generation: catalog_v1.CatalogGeneration
    entries: tuple[catalog_v1.CatalogEntry, ...]

    def summary(self) -> dict[str, Any]:
        g = self.generation
        return {
            "org_id": g.scope.org_id,
            "app_installation_id": g.scope.app_installation_id,
            "runtime_capability_id": g.scope.runtime_capability_id,
            "runtime_work_binding_digest": self.binding_digest,
            "catalog_generation_id": g.catalog_generation_id,
            "state": catalog_v1.GenerationState.Name(g.state),
            "catalog_digest": g.catalog_digest,
            "entries": [
                {
                    "action_type": e.action_type,
                    "contract_only": e.contract_only,
                    "entry_digest": e.entry_digest,
                    "binding_fingerprint": e.binding_fingerprint,
                }
                for e in self.entries
            ],
        }


# --- parsing ----------------------------------------------------------------------------


def _issues_text(where: str, issues: Sequence[object]) -> str:
    lines = []
    for d in issues:
        if isinstance(d, Diagnostic):
            lines.append(f"  {where}{'.' + d.path if d.path else ''}: {d.code.value}: {d.message}")
        else:  # CatalogDiagnostic
            field = getattr(d, "field", "")
            code = getattr(d, "code", "")
            lines.append(
                f"  {where}{'.' + field if field else ''}: {getattr(code, 'value', code)}: "
                f"{getattr(d, 'message', '')}"
            )
    return "\n".join(lines)


def _mapping(raw: object, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise CliError(f"{where}: expected an object")
    return raw


def _view(raw: object) -> catalog_v1.MetadataView:
    m = dict(_mapping(raw, "metadata_view"))
    schema_generation = m.pop("schema_generation", None)
    if not isinstance(schema_generation, int) or isinstance(schema_generation, bool):
        raise CliError("metadata_view.schema_generation: an integer is required")
    try:
        view = RuntimeMetadataView.from_dict(m)
    except DomainValidationError as exc:
        raise CliError(
            "invalid metadata_view:\n" + _issues_text("metadata_view", exc.issues)
        ) from exc
    msg = view_to_proto(
        view,
        org_id="",
        app_installation_id="",
        digest="",
        schema_generation=schema_generation,
        created_at=datetime.now(UTC),
    )
    msg.ClearField("created_at")
    return msg


def _entry(raw: object, index: int) -> catalog_v1.SubmitEntryRequest:
    where = f"entries[{index}]"
    m = dict(_mapping(raw, where))
    source = m.pop("source", None)
    if source is not None and source != _DISTRIBUTION:
        raise CliError(f"{where}.source: only {_DISTRIBUTION!r} may be given (else owner.kind)")
    if source == _DISTRIBUTION:
        m.setdefault("owner", {"kind": "platform", "registration_id": "distribution"})
        if m.get("handler_binding") is None:
            raise CliError(f"{where}.handler_binding: a distribution entry binds a handler")
    hb_raw = m.get("handler_binding")
    if isinstance(hb_raw, Mapping) and "asserted_capability" in hb_raw:
        raise CliError(
            f"{where}.handler_binding.asserted_capability: not supported; submit the asserted "
            "capability as the descriptor of a `source: distribution` entry"
        )
    try:
        sub = CatalogEntrySubmission.from_dict(m)
    except DomainValidationError as exc:
        raise CliError(f"invalid {where}:\n" + _issues_text(where, exc.issues)) from exc
    descriptor: CapabilityDescriptor = sub.descriptor.normalized()
    handler: HandlerBinding | None = sub.handler_binding
    req = catalog_v1.SubmitEntryRequest(
        action_type=sub.action_type,
        descriptor=descriptor_to_proto(descriptor),
        contract_only=handler is None,
    )
    if source == _DISTRIBUTION:
        req.source = catalog_v1.EntrySource.ENTRY_SOURCE_DISTRIBUTION
    else:
        req.source = catalog_v1.EntrySource.ValueType(int(sub.owner.kind))
    if handler is None:
        req.handler_binding.CopyFrom(
            common_v1.HandlerBinding(owner_registration_id=sub.owner.registration_id)
        )
    else:
        req.handler_binding.CopyFrom(handler_binding_to_proto(handler))
    return req


def parse_build_document(doc: object) -> BuildPlan:
    """Parse a build document (see module docstring).

    Raises:
        CliError: with every field issue found in the failing section.
    """
    m = _mapping(doc, "document")
    unknown = sorted(set(m) - _TOP_KEYS)
    if unknown:
        raise CliError(f"unknown top-level keys {unknown}; expected {sorted(_TOP_KEYS)}")
    binding = dict(_mapping(m.get("binding"), "binding"))
    unknown = sorted(set(binding) - _BINDING_KEYS)
    if unknown:
        raise CliError(f"binding: unknown keys {unknown}; expected {sorted(_BINDING_KEYS)}")
    entries = m.get("entries") or []
    if not isinstance(entries, list):
        raise CliError("entries: expected a list")
    contract_version = m.get("contract_version", 1)
    if not isinstance(contract_version, int) or isinstance(contract_version, bool):
        raise CliError("contract_version: expected an integer")

    def text(key: str) -> str | None:
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise CliError(f"{key}: expected a string")
        return value

    return BuildPlan(
        org_id=text("org_id"),
        app_installation_id=text("app_installation_id"),
        runtime_capability_id=text("runtime_capability_id"),
        view=None if m.get("metadata_view") is None else _view(m["metadata_view"]),
        binding=binding,
        contract_version=contract_version,
        entries=tuple(_entry(raw, i) for i, raw in enumerate(entries)),
    )


# --- calls ------------------------------------------------------------------------------

#: ``(org, installation, capability, binding digest) -> call metadata``.
Credentials = Callable[[str, str | None, str | None, str | None], Sequence[tuple[str, str]]]


def _request_id() -> str:
    return f"flowctl-{uuid.uuid4().hex}"


def _list_entries(
    stub: Any, scope: common_v1.TrustedRuntimeWorkScope, generation: Any, md: Any
) -> tuple[catalog_v1.CatalogEntry, ...]:
    out: list[catalog_v1.CatalogEntry] = []
    token = ""
    for _ in range(10_000):
        resp = stub.ListEntries(
            catalog_v1.ListEntriesRequest(
                scope=scope,
                catalog_generation_id=generation.catalog_generation_id,
                catalog_digest=generation.catalog_digest,
                page_token=token,
            ),
            metadata=md,
            timeout=_CALL_TIMEOUT_S,
        )
        out.extend(resp.entries)
        token = resp.next_page_token
        if not token:
            break
    return tuple(out)


def build_catalog(
    channel: grpc.Channel,
    plan: BuildPlan,
    *,
    org_id: str,
    app_installation_id: str,
    runtime_capability_id: str,
    credentials: Credentials,
    seal: bool,
) -> BuildResult:
    """Publish the view, register the binding, open a generation, submit, optionally seal."""
    stub = catalog_v1.CatalogServiceStub(channel)
    org, inst, cap = org_id, app_installation_id, runtime_capability_id
    binding_values = dict(plan.binding)
    if plan.view is not None:
        view = catalog_v1.MetadataView()
        view.CopyFrom(plan.view)
        view.org_id, view.app_installation_id = org, inst
        published = stub.PublishMetadataView(
            catalog_v1.PublishMetadataViewRequest(request_id=_request_id(), org_id=org, view=view),
            metadata=credentials(org, inst, None, None),
            timeout=_CALL_TIMEOUT_S,
        ).view
        binding_values.setdefault(
            "runtime_metadata_view_digest", published.runtime_metadata_view_digest
        )
    try:
        binding = common_v1.RuntimeWorkBinding(
            org_id=org, app_installation_id=inst, runtime_capability_id=cap, **binding_values
        )
    except (TypeError, ValueError) as exc:
        raise CliError(f"binding: {exc}") from exc
    registered = stub.RegisterWorkBinding(
        catalog_v1.RegisterWorkBindingRequest(
            request_id=_request_id(), org_id=org, binding=binding
        ),
        metadata=credentials(org, inst, cap, None),
        timeout=_CALL_TIMEOUT_S,
    ).work_binding
    digest = registered.runtime_work_binding_digest
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
        runtime_work_binding_digest=digest,
    )
    md = credentials(org, inst, cap, digest)
    generation = stub.OpenGeneration(
        catalog_v1.OpenGenerationRequest(
            request_id=_request_id(), scope=scope, contract_version=plan.contract_version
        ),
        metadata=md,
        timeout=_CALL_TIMEOUT_S,
    ).generation
    gid = generation.catalog_generation_id
    submitted: list[catalog_v1.CatalogEntry] = []
    for entry in plan.entries:
        req = catalog_v1.SubmitEntryRequest()
        req.CopyFrom(entry)
        req.request_id = _request_id()
        req.scope.CopyFrom(scope)
        req.catalog_generation_id = gid
        submitted.append(stub.SubmitEntry(req, metadata=md, timeout=_CALL_TIMEOUT_S).entry)
    if seal:
        generation = stub.SealGeneration(
            catalog_v1.SealGenerationRequest(
                request_id=_request_id(), scope=scope, catalog_generation_id=gid
            ),
            metadata=md,
            timeout=_CALL_TIMEOUT_S,
        ).generation
        entries = _list_entries(stub, scope, generation, md)
    else:
        entries = tuple(
            sorted({e.action_type: e for e in submitted}.values(), key=lambda e: e.action_type)
        )
    return BuildResult(digest, generation, entries)


# --- commands ---------------------------------------------------------------------------


def _credentials(args: argparse.Namespace) -> Credentials:
    def mint(
        org: str, inst: str | None, cap: str | None, digest: str | None
    ) -> Sequence[tuple[str, str]]:
        scoped = argparse.Namespace(
            **{
                **vars(args),
                "org": org,
                "app_installation": inst,
                "capability": cap,
                "binding_digest": digest,
            }
        )
        return call_metadata(scoped, ServiceName.CATALOG)

    return mint


def _build(args: argparse.Namespace) -> int:
    plan = parse_build_document(load_document(args.file))
    org = plan.org_id or args.org
    inst = plan.app_installation_id or args.app_installation
    cap = plan.runtime_capability_id or args.capability
    if not inst or not cap:
        raise CliError(
            "the app installation and runtime capability are required "
            "(document keys app_installation_id / runtime_capability_id, or "
            "--app-installation / --capability)"
        )
    with channel_for(args.target) as channel:
        result = build_catalog(
            channel,
            plan,
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            credentials=_credentials(args),
            seal=args.seal,
        )
    print(json.dumps(result.summary(), indent=2))
    return 0


def _show(args: argparse.Namespace) -> int:
    if not (args.app_installation and args.capability and args.binding_digest):
        raise CliError("--app-installation, --capability and --binding-digest are required")
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=args.org,
        app_installation_id=args.app_installation,
        runtime_capability_id=args.capability,
        runtime_work_binding_digest=args.binding_digest,
    )
    md = call_metadata(args, ServiceName.CATALOG)
    with channel_for(args.target) as channel:
        stub = catalog_v1.CatalogServiceStub(channel)
        generation = stub.GetGeneration(
            catalog_v1.GetGenerationRequest(scope=scope, catalog_generation_id=args.generation),
            metadata=md,
            timeout=_CALL_TIMEOUT_S,
        ).generation
        sealed = generation.state == catalog_v1.GenerationState.GENERATION_STATE_SEALED
        entries = _list_entries(stub, scope, generation, md) if sealed else ()
    out = {
        "generation": json_format.MessageToDict(generation, preserving_proto_field_name=True),
        "entries": [
            json_format.MessageToDict(e, preserving_proto_field_name=True) for e in entries
        ],
    }
    print(json.dumps(out, indent=2))
    return 0


def register(groups: Any) -> None:
    """Add the ``catalog`` command group to ``flowctl``."""
    catalog = groups.add_parser("catalog", help="capability-catalog generations")
    commands = catalog.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="build a generation from a YAML/JSON file")
    build.add_argument("file", help="build document (YAML or JSON; '-' for stdin)")
    build.add_argument("--seal", action="store_true", help="seal the generation after submitting")
    add_connection_args(build, ServiceName.CATALOG)
    build.set_defaults(func=_build)

    show = commands.add_parser("show", help="show a generation and its sealed entries")
    show.add_argument("--generation", required=True, help="catalog generation id")
    add_connection_args(show, ServiceName.CATALOG)
    show.set_defaults(func=_show)
