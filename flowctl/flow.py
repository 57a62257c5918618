"""``flowctl flow …``: compile and draw plans locally; register, activate and inventory Flows.

Local and pure (no server; the same :func:`runtime_svc.compiler.compile_plan` activation
uses)::

    flowctl flow compile FILE --inputs DIR [--explain | --json]
    flowctl flow plan FILE --inputs DIR [--mermaid | --json]
    flowctl flow compile FILE [--generation G --catalog-digest C]   # against a running catalog

``FILE`` is a Flow document (JSON or YAML). ``--inputs`` is a directory holding
``binding.json``, ``catalog.json``, ``metadata_view.json``, ``policy.json`` and optionally
``subflows/*.json`` (the layout of ``tests/flows/_inputs``), or one JSON/YAML bundle file
``{"binding", "catalog", "metadata_view", "policy", "subflows"}``. Without ``--inputs`` the
inputs are read from a sealed generation on a running catalog (``--generation`` and
``--catalog-digest``, by default the demo's from ``make run``'s ``demo.json``; subflows
from the runtime's registered versions; the policy an org is seeded with; the registered
wait producers — the inputs activation builds), so
``flowctl flow compile examples/flows/welcome_contact.json`` works on the demo stack. A
rejected compile prints every diagnostic (with its transitive blocker chain) and exits 1.

Through the runtime's FlowDefinitionService (gRPC; connection flags as for every
command, the work-scoped ones need ``--app-installation --capability --binding-digest``)::

    flowctl flow register FILE [--label L]
    flowctl flow activate --flow-version ID (--plan-id P --plan-digest D
                                             | --generation G --catalog-digest C)
    flowctl flow inventory --generation G --catalog-digest C [--flow NAME …] [--json]

``activate`` with a generation compiles first and activates the plan it yields.
``inventory`` compiles every active Flow (or the named ones) without changing execution
and prints profile, rejection reason, unknown capabilities, loop/fan-out proof, step
count, legacy behaviour and cohort per Flow (§20.4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from flowctl.common import (
    DEMO_SUMMARY_FILE,
    CliError,
    UsageError,
    add_connection_args,
    call_metadata,
    channel_for,
    load_document,
    print_message,
    work_scope,
)
from runtime_svc.catalog_client import GrpcCatalogClient, ScopedCredentials
from runtime_svc.compiler import (
    CompilerInputs,
    ExecutionPlan,
    FlowSourceError,
    PlanCompileError,
    compile_plan,
    explain,
    load_flow_text,
    to_mermaid,
)
from runtime_svc.definitions.inputs import CatalogSnapshot, build_compiler_inputs
from runtime_svc.definitions.policy import default_policy_generation
from runtime_svc.definitions.source import SubflowRef, collect_subflows, subflow_refs
from runtime_svc.waits.registry import ProducerRegistry
from services.auth import TrustedRuntimeWorkScope
from services.config import ServiceName, load_config
from services.errors import FlowError
from services.proto import common_v1, runtime_v1

__all__ = ["compile_file", "format_issues", "load_inputs", "register"]

_CALL_TIMEOUT_S = 60.0
#: Bound on the ListFlowVersions pages read for one subflow.
_MAX_PAGES = 100
_INPUT_FILES = ("binding", "catalog", "metadata_view", "policy")


def load_inputs(path: str) -> CompilerInputs:
    """Compiler inputs from a directory (``tests/flows/_inputs`` layout) or a bundle file."""
    p = Path(path)
    try:
        if p.is_dir():
            doc: dict[str, Any] = {}
            for name in _INPUT_FILES:
                f = p / f"{name}.json"
                if not f.exists():
                    raise CliError(f"{path}: missing {f.name}")
                doc[name] = json.loads(f.read_text(encoding="utf-8"))
            doc["subflows"] = [
                load_flow_text(s.read_text(encoding="utf-8"))
                for s in sorted((p / "subflows").glob("*.json"))
            ]
        else:
            doc = load_document(path)
        return CompilerInputs.from_dict(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{path}: unusable compiler inputs: {exc}") from exc


def _load_flow(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        return load_flow_text(text)
    except (OSError, FlowSourceError) as exc:
        raise CliError(f"{path}: {exc}") from exc


def compile_file(flow_path: str, inputs_path: str) -> ExecutionPlan:
    """Compile one Flow file against local inputs.

    Raises:
        PlanCompileError: the compiler rejected the Flow.
        CliError: unreadable files.
    """
    return compile_plan(_load_flow(flow_path), load_inputs(inputs_path))


def format_issues(exc: PlanCompileError) -> str:
    """One line per issue: ``path: [code] message (blocker: A → B)``."""
    lines = [f"{len(exc.issues)} compile issue(s):"]
    for i in exc.issues:
        chain = f" (blocker: {' → '.join(i.blocker_chain)})" if i.blocker_chain else ""
        lines.append(f"  {i.path}: [{i.code}] {i.message}{chain}")
    return "\n".join(lines) + "\n"


def _demo_generation(args: argparse.Namespace) -> tuple[str, str]:
    """``--generation/--catalog-digest``, else the demo's from ``make run``'s demo.json."""
    if args.generation and args.catalog_digest:
        return args.generation, args.catalog_digest
    if args.generation or args.catalog_digest:
        raise UsageError("give --generation and --catalog-digest together")
    path = load_config(ServiceName.RUNTIME).data_dir / DEMO_SUMMARY_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return str(doc["catalog_generation_id"]), str(doc["catalog_digest"])
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(
            "give --inputs DIR|FILE, or --generation and --catalog-digest of a sealed generation "
            f"on a running stack (no usable {path} to take the demo's from)"
        ) from exc


async def _runtime_subflows(
    flow: dict[str, Any], args: argparse.Namespace
) -> list[Mapping[str, Any]]:
    """The registered Flow versions ``flow`` reaches by Subflow, read from the runtime's
    ``ListFlowVersions`` with the closure walk activation uses (no call without Subflows)."""
    if not subflow_refs(flow):
        return []
    metadata = call_metadata(args, ServiceName.RUNTIME)
    channel = grpc.aio.insecure_channel(args.target)
    stub = runtime_v1.FlowDefinitionServiceStub(channel)

    async def fetch(ref: SubflowRef) -> tuple[Mapping[str, Any], str] | None:
        token = ""
        for _ in range(_MAX_PAGES):
            try:
                resp = await stub.ListFlowVersions(
                    runtime_v1.ListFlowVersionsRequest(
                        org_id=args.org, flow_api_name=ref.api_name, page_token=token
                    ),
                    metadata=metadata,
                    timeout=_CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                raise CliError(
                    f"runtime {args.target}: cannot read subflow {ref.api_name}@{ref.version}: "
                    f"{exc.code().name}: {exc.details()}"
                ) from exc
            for v in resp.flow_versions:
                if v.flow_api_name == ref.api_name and v.version_number == ref.version:
                    return json.loads(v.source_json), v.flow_version_id
            token = resp.next_page_token
            if not token:
                break
        return None

    try:
        sources, _ = await collect_subflows(flow, fetch)
    finally:
        await channel.close()
    return sources


def catalog_inputs(flow: dict[str, Any], args: argparse.Namespace) -> CompilerInputs:
    """Compiler inputs of a sealed generation read from a running catalog.

    Built as activation builds them (``PlanCompiler.compile``): the generation, its
    entries, binding and metadata view from the catalog (the reads activation makes); the
    subflow closure from the runtime's registered Flow versions (the same walk); the
    policy an org is seeded with; the wait producers the runtime registers
    (``FLOW_RUNTIME_SIGNAL_KINDS``). The same inputs give the same plan digest.
    """
    generation, digest = _demo_generation(args)
    scope = work_scope(args, f"flow {args.command} against a catalog generation")
    trusted = TrustedRuntimeWorkScope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )
    cfg = load_config(ServiceName.CATALOG)

    async def snapshot() -> CatalogSnapshot:
        channel = grpc.aio.insecure_channel(args.catalog_target)
        creds = ScopedCredentials(cfg.auth_signing_key, cfg.auth_signing_key_id, subject="flowctl")
        try:
            return await GrpcCatalogClient(channel, creds).load_snapshot(
                trusted, generation, digest
            )
        finally:
            await channel.close()

    async def read() -> tuple[CatalogSnapshot, list[Mapping[str, Any]]]:
        try:
            snap = await snapshot()
        except FlowError as exc:
            raise CliError(f"catalog generation {generation}: {exc}") from exc
        return snap, await _runtime_subflows(flow, args)

    snap, subflows = asyncio.run(read())
    version = flow.get("version")
    return build_compiler_inputs(
        snap,
        default_policy_generation(args.org).compiler_document(),
        subflows,
        flow_versions={str(flow.get("api_name")): version if isinstance(version, int) else 0},
        # The producers the runtime registers (FLOW_RUNTIME_SIGNAL_KINDS), as activation
        # passes them: the same inputs give the same plan digest.
        wait_producers=ProducerRegistry(
            load_config(ServiceName.RUNTIME).runtime_signal_kinds
        ).compiler_producers(),
    )


def compile_against_catalog(flow_path: str, args: argparse.Namespace) -> ExecutionPlan:
    """Compile locally against a sealed generation read from a running catalog."""
    flow = _load_flow(flow_path)
    return compile_plan(flow, catalog_inputs(flow, args))


def _flow_and_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], CompilerInputs]:
    """The Flow of ``args.file`` and the inputs it compiles against: ``--inputs``, else a
    sealed generation of a running catalog."""
    flow = _load_flow(args.file)
    if args.inputs:
        return flow, load_inputs(args.inputs)
    return flow, catalog_inputs(flow, args)


def _compile_cmd(args: argparse.Namespace) -> int:
    flow, inputs = _flow_and_inputs(args)
    try:
        plan = compile_plan(flow, inputs)
    except PlanCompileError as exc:
        sys.stdout.write(format_issues(exc))
        return 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
    else:
        # Each dependency with its producer contract and the policy's wait bounds.
        notes = ProducerRegistry(load_config(ServiceName.RUNTIME).runtime_signal_kinds).explainer(
            inputs.policy
        )
        sys.stdout.write(explain(plan, notes))
    return 0


def _plan_cmd(args: argparse.Namespace) -> int:
    flow, inputs = _flow_and_inputs(args)
    try:
        plan = compile_plan(flow, inputs)
    except PlanCompileError as exc:
        sys.stdout.write(format_issues(exc))
        return 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
    else:
        sys.stdout.write(to_mermaid(plan))
    return 0


# --- remote commands ---------------------------------------------------------------------


def _scope(args: argparse.Namespace) -> Any:
    return work_scope(args, f"flow {args.command}")


def _stub(channel: grpc.Channel) -> Any:
    return runtime_v1.FlowDefinitionServiceStub(channel)


def _register_cmd(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    try:
        doc = load_flow_text(text)
    except FlowSourceError as exc:
        raise CliError(f"{args.file}: {exc}") from exc
    # The service takes JSON; a YAML file is sent as its JSON rendering.
    source = text if text.lstrip().startswith("{") else json.dumps(doc)
    with channel_for(args.target) as channel:
        resp = _stub(channel).RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(
                request_id=uuid.uuid4().hex,
                org_id=args.org,
                flow_api_name=str(doc.get("api_name", "")),
                source_json=source,
                label=args.label or "",
            ),
            metadata=call_metadata(args, ServiceName.RUNTIME),
            timeout=_CALL_TIMEOUT_S,
        )
    print_message(resp.flow_version)
    return 0


def _print_diagnostics(diagnostics: Any) -> None:
    for d in diagnostics:
        severity = runtime_v1.DiagnosticSeverity.Name(d.severity).removeprefix(
            "DIAGNOSTIC_SEVERITY_"
        )
        chain = f" (blocker: {' → '.join(d.blocker_chain)})" if d.blocker_chain else ""
        print(f"  {severity.lower()} {d.path}: [{d.code}] {d.message}{chain}")


def _activate_cmd(args: argparse.Namespace) -> int:
    scope = _scope(args)
    md = call_metadata(args, ServiceName.RUNTIME)
    with channel_for(args.target) as channel:
        stub = _stub(channel)
        plan_id, plan_digest = args.plan_id, args.plan_digest
        if not plan_id:
            if not (args.generation and args.catalog_digest):
                raise CliError("give --plan-id/--plan-digest or --generation/--catalog-digest")
            compiled = stub.CompileFlowVersion(
                runtime_v1.CompileFlowVersionRequest(
                    request_id=uuid.uuid4().hex,
                    scope=scope,
                    flow_version_id=args.flow_version,
                    catalog_generation_id=args.generation,
                    catalog_digest=args.catalog_digest,
                ),
                metadata=md,
                timeout=_CALL_TIMEOUT_S,
            )
            if not compiled.compiled:
                print("compile rejected:")
                _print_diagnostics(compiled.diagnostics)
                return 1
            plan_id, plan_digest = compiled.plan.plan_id, compiled.plan.plan_digest
        resp = stub.ActivateFlowVersion(
            runtime_v1.ActivateFlowVersionRequest(
                request_id=uuid.uuid4().hex,
                scope=scope,
                flow_version_id=args.flow_version,
                plan_id=plan_id,
                plan_digest=plan_digest or "",
            ),
            metadata=md,
            timeout=_CALL_TIMEOUT_S,
        )
    print_message(resp.activation)
    return 0


def _inventory_rows(entries: Any) -> str:
    lines = []
    for e in entries:
        profile = common_v1.ExecutionProfile.Name(e.selected_profile).removeprefix(
            "EXECUTION_PROFILE_"
        )
        cohort = runtime_v1.MigrationCohort.Name(e.migration_cohort).removeprefix(
            "MIGRATION_COHORT_"
        )
        lines.append(
            f"{e.flow_api_name} ({e.flow_version_id}): "
            f"{'compilable' if e.compilable else 'REJECTED'}, profile {profile.lower()}, "
            f"cohort {cohort.lower()}, steps {e.estimated_step_count}, "
            f"fan-out {'proven' if e.fanout_proven else 'unproven'}"
        )
        lines += [f"    unknown capability: {u}" for u in e.unknown_capabilities]
        lines += [f"    legacy: {b}" for b in e.legacy_behaviors]
        for d in e.diagnostics:
            chain = f" (blocker: {' → '.join(d.blocker_chain)})" if d.blocker_chain else ""
            lines.append(f"    {d.path}: [{d.code}] {d.message}{chain}")
    return "\n".join(lines) + ("\n" if lines else "no active Flows\n")


def _inventory_cmd(args: argparse.Namespace) -> int:
    scope = _scope(args)
    entries: list[Any] = []
    token = ""
    with channel_for(args.target) as channel:
        stub = _stub(channel)
        for _ in range(10_000):  # bounded paging
            resp = stub.GetInventory(
                runtime_v1.GetInventoryRequest(
                    scope=scope,
                    catalog_generation_id=args.generation,
                    catalog_digest=args.catalog_digest,
                    flow_api_names=args.flow or [],
                    page_token=token,
                ),
                metadata=call_metadata(args, ServiceName.RUNTIME),
                timeout=_CALL_TIMEOUT_S,
            )
            entries.extend(resp.entries)
            token = resp.next_page_token
            if not token:
                break
    if args.json:
        rows = [json_format.MessageToDict(e, preserving_proto_field_name=True) for e in entries]
        print(json.dumps(rows, indent=2))
    else:
        sys.stdout.write(_inventory_rows(entries))
    return 0


def _compile_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--inputs",
        default="",
        help="compiler inputs directory or bundle file; without it: a sealed generation on a "
        "running stack (--generation/--catalog-digest, default the demo's)",
    )
    p.add_argument("--generation", default="", help="sealed catalog generation id")
    p.add_argument("--catalog-digest", default="", help="its catalog digest")
    p.add_argument(
        "--catalog-target",
        default=f"127.0.0.1:{load_config(ServiceName.CATALOG).port}",
        help="host:port of the catalog (default from configuration)",
    )
    add_connection_args(p, ServiceName.RUNTIME)


def register(groups: Any) -> None:
    """Add the ``flow`` command group."""
    flow = groups.add_parser("flow", help="compile, draw, register, activate, inventory Flows")
    commands = flow.add_subparsers(dest="command", required=True)

    compile_p = commands.add_parser("compile", help="compile a Flow file locally")
    compile_p.add_argument("file", help="Flow document (JSON or YAML; - = stdin)")
    _compile_source_args(compile_p)
    out = compile_p.add_mutually_exclusive_group()
    out.add_argument("--explain", action="store_true", help="human explanation (default)")
    out.add_argument("--json", action="store_true", help="the canonical plan JSON")
    compile_p.set_defaults(func=_compile_cmd)

    plan_p = commands.add_parser("plan", help="draw a Flow's compiled plan")
    plan_p.add_argument("file", help="Flow document (JSON or YAML; - = stdin)")
    _compile_source_args(plan_p)
    out = plan_p.add_mutually_exclusive_group()
    out.add_argument("--mermaid", action="store_true", help="Mermaid flowchart (default)")
    out.add_argument("--json", action="store_true", help="the canonical plan JSON")
    plan_p.set_defaults(func=_plan_cmd)

    reg = commands.add_parser("register", help="register a Flow version (gRPC)")
    reg.add_argument("file", help="Flow document (JSON or YAML; - = stdin)")
    reg.add_argument("--label", default="", help="display label")
    add_connection_args(reg, ServiceName.RUNTIME)
    reg.set_defaults(func=_register_cmd)

    act = commands.add_parser("activate", help="activate a Flow version on a plan (gRPC)")
    act.add_argument("--flow-version", required=True, help="Flow version id")
    act.add_argument("--plan-id", default="", help="plan to activate")
    act.add_argument("--plan-digest", default="", help="expected digest of --plan-id")
    act.add_argument("--generation", default="", help="compile against this generation first")
    act.add_argument("--catalog-digest", default="", help="digest of --generation")
    add_connection_args(act, ServiceName.RUNTIME)
    act.set_defaults(func=_activate_cmd)

    inv = commands.add_parser("inventory", help="compile-only inventory of active Flows (gRPC)")
    inv.add_argument("--generation", required=True, help="sealed catalog generation id")
    inv.add_argument("--catalog-digest", required=True, help="its catalog digest")
    inv.add_argument("--flow", action="append", help="only this Flow API name (repeatable)")
    inv.add_argument("--json", action="store_true", help="JSON rows")
    add_connection_args(inv, ServiceName.RUNTIME)
    inv.set_defaults(func=_inventory_cmd)
