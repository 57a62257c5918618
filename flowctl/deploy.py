"""``flowctl deploy …``: the §20 rollout controller's typed commands, and
``flowctl release evidence``.

They act on the runtime database (``FLOW_RUNTIME_DB_URL``, or ``--db-url``) through
:mod:`runtime_svc.migration` — each a short compare-and-swap transaction on the deployment
control record — so no rollout, gate or rollback step is ever manual production SQL
(§20.9). Every command prints JSON; a refused gate exits 1 with its reasons and evidence.

::

    flowctl deploy status
    flowctl deploy bridge begin                       # adopter: enter the additive window
    flowctl deploy routing mint --org O --app-installation A --capability C --binding-digest D
    flowctl deploy org-backfill --routing FILE        # repeatable trusted OrgID sweep
    flowctl deploy drain begin [--restart] | drain verify
    flowctl deploy org-schema --routing FILE          # final sweep, adoption, receipt
    flowctl deploy write-protocol enable
    flowctl deploy admission enable|disable           # new V2 runs only
    flowctl deploy default-owner legacy|v2
    flowctl deploy cohort set --org O --flow-version V --profile P --owner v2 \\
        --cohort pure_autolaunched --evidence COMPARISON_ID
    flowctl deploy cohort list [--org O]
    flowctl deploy shadow --org O --flow-version V --scenarios FILE [--view FILE]
    flowctl deploy reconcile [--org O] [--prometheus]
    flowctl deploy rollback-check --target VERSION
    flowctl deploy quarantine clear --reason R
    flowctl release evidence [--head SHA]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from flowctl.common import load_document
from runtime_svc.compiler import MetadataViewInput
from runtime_svc.definitions.inventory import Cohort
from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import backfill, bridge, cohorts, evidence, reconcile, shadow
from runtime_svc.migration.authority import ROUTING_ROLE, resolve_authority
from runtime_svc.migration.shadow_model import Scenario
from runtime_svc.records import RecordView
from services import db
from services.auth import (
    CredentialVerifier,
    WorkloadClaims,
    load_signing_key,
    load_trusted_keys,
    mint_credential,
)
from services.config import ServiceName, load_config
from services.errors import FlowError

__all__ = ["register"]

T = TypeVar("T")
_OWNERS = {"legacy": ExecutionOwner.LEGACY_INTERPRETER, "v2": ExecutionOwner.FLOW_RUNTIME_V2}


def _db_url(args: argparse.Namespace) -> str:
    return str(args.db_url or load_config(ServiceName.RUNTIME).db_url)


def _run(args: argparse.Namespace, fn: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    async def main() -> T:
        engine = db.create_engine(_db_url(args), pool_size=2)
        try:
            return await fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def _refused(exc: FlowError) -> int:
    body: dict[str, Any] = {"refused": exc.safe_message, "reason": exc.reason}
    if isinstance(exc, bridge.GateRefusedError):
        body |= {"reasons": list(exc.reasons), "evidence": exc.evidence}
    _print(body)
    return 1


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except FlowError as exc:
            return _refused(exc)

    return run


# --- commands -------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    async def fn(engine: AsyncEngine) -> dict[str, Any]:
        control = await bridge.read_control(engine)
        return {
            "control": control.to_dict(),
            "runs_by_owner": await bridge.count_owned_runs(engine),
        }

    _print(_run(args, fn))
    return 0


def _control(op: Callable[[AsyncEngine], Awaitable[Any]]) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        control = _run(args, op)
        _print(control.to_dict())
        return 0

    return _guarded(command)


def _statements(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _authority(args: argparse.Namespace) -> Any:
    cfg = load_config(ServiceName.RUNTIME)
    verifier = CredentialVerifier(
        load_trusted_keys(cfg.auth_trusted_keys),
        ServiceName.RUNTIME,
        clock_skew_s=cfg.auth_clock_skew_s,
    )
    return resolve_authority(_statements(args.routing), verifier)


def _mint_routing(args: argparse.Namespace) -> int:
    cfg = load_config(ServiceName.RUNTIME)
    claims = WorkloadClaims(
        subject="deployment-routing",
        audiences=(ServiceName.RUNTIME,),
        org_id=args.org,
        app_installation_id=args.app_installation,
        runtime_capability_id=args.capability,
        runtime_work_binding_digest=args.binding_digest,
        roles=(ROUTING_ROLE,),
    )
    key = load_signing_key(cfg.auth_signing_key)
    print(mint_credential(key, cfg.auth_signing_key_id, claims, ttl_s=args.ttl))
    return 0


@_guarded
def _org_backfill(args: argparse.Namespace) -> int:
    authority = _authority(args)
    receipt = _run(args, lambda e: backfill.org_backfill_sweep(e, authority))
    _print(receipt.to_dict())
    return 0 if receipt.complete else 1


@_guarded
def _org_schema(args: argparse.Namespace) -> int:
    authority = _authority(args)
    receipt = _run(args, lambda e: bridge.org_schema_gate(e, authority, LegacyInterviewStore(e)))
    _print(receipt.to_dict())
    return 0


@_guarded
def _drain(args: argparse.Namespace) -> int:
    if args.step == "begin":
        control = _run(args, lambda e: bridge.drain_begin(e, restart=args.restart))
    else:
        control = _run(args, bridge.drain_verify)
    _print(control.to_dict())
    return 0


@_guarded
def _admission(args: argparse.Namespace) -> int:
    enabled = args.state == "enable"
    control = _run(args, lambda e: bridge.set_v2_admission(e, enabled=enabled))
    _print(control.to_dict())
    return 0


@_guarded
def _default_owner(args: argparse.Namespace) -> int:
    control = _run(args, lambda e: bridge.set_default_owner(e, _OWNERS[args.owner]))
    _print(control.to_dict())
    return 0


@_guarded
def _cohort_set(args: argparse.Namespace) -> int:
    flag = _run(
        args,
        lambda e: cohorts.set_cohort(
            e,
            args.org,
            args.flow_version,
            args.profile,
            _OWNERS[args.owner],
            cohort=args.cohort,
            evidence_comparison_id=args.evidence,
        ),
    )
    _print(flag.to_dict())
    return 0


def _cohort_list(args: argparse.Namespace) -> int:
    flags = _run(args, lambda e: cohorts.list_cohorts(e, args.org))
    _print([f.to_dict() for f in flags])
    return 0


@_guarded
def _shadow(args: argparse.Namespace) -> int:
    doc = load_document(args.scenarios)
    scenarios = [Scenario.from_dict(s) for s in (doc.get("scenarios") or [])]
    view = None
    if args.view:
        view = RecordView.from_metadata_view(MetadataViewInput.from_dict(load_document(args.view)))
    results = _run(
        args,
        lambda e: shadow.compare_flow_version(e, args.org, args.flow_version, scenarios, view=view),
    )
    _print([{"comparison_id": r.comparison_id, **r.comparison.to_dict()} for r in results])
    return 1 if any(r.comparison.unexplained for r in results) else 0


def _reconcile(args: argparse.Namespace) -> int:
    report = _run(args, lambda e: reconcile.reconcile_ownership(e, args.org))
    if args.prometheus:
        sys.stdout.write(reconcile.metrics_text(report))
    else:
        _print(report.to_dict())
    return 1 if report.dual_ownership_total else 0


def _rollback_check(args: argparse.Namespace) -> int:
    verdict = _run(args, lambda e: evidence.rollback_check(e, args.target))
    _print(verdict.to_dict())
    return 0 if verdict.allowed else 1


@_guarded
def _quarantine_clear(args: argparse.Namespace) -> int:
    control = _run(args, lambda e: bridge.clear_quarantine(e, args.reason))
    _print(control.to_dict())
    return 0


def _release_evidence(args: argparse.Namespace) -> int:
    url = _db_url(args)
    document = _run(
        args,
        lambda e: evidence.release_evidence(
            e, url, head_sha=args.head, expected_version=args.expected_version
        ),
    )
    if args.summary:
        print("\n".join(evidence.summary_lines(document)))
    else:
        _print(document)
    failed = any(
        document[g]["status"] == "fail" for g in ("source_gate", "release_gate", "staging_gate")
    )
    return 1 if failed else 0


# --- parser ---------------------------------------------------------------------------


def _db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db-url", default=None, help="runtime database (default: config)")


def register(groups: Any) -> None:
    deploy = groups.add_parser("deploy", help="§20 bridge, cohorts, rollback (rollout controller)")
    cmds = deploy.add_subparsers(dest="command", required=True)

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = cmds.add_parser(name, help=help_)
        _db(p)
        p.set_defaults(func=fn)
        return p

    add("status", _status, "the control record and runs per owner")
    begin = cmds.add_parser("bridge", help="enter the pre-bridge additive window (adopters)")
    begin.add_argument("step", choices=["begin"])
    _db(begin)
    begin.set_defaults(func=_control(bridge.bridge_begin))
    routing = cmds.add_parser("routing", help="deployment routing statements")
    routing.add_argument("step", choices=["mint"])
    routing.add_argument("--org", required=True)
    routing.add_argument("--app-installation", required=True)
    routing.add_argument("--capability", required=True)
    routing.add_argument("--binding-digest", required=True)
    routing.add_argument("--ttl", type=int, default=3600)
    routing.set_defaults(func=_mint_routing)
    add("org-backfill", _org_backfill, "one trusted OrgID sweep").add_argument(
        "--routing", required=True, help="file of routing statements (one per line, - = stdin)"
    )
    drain = add("drain", _drain, "start draining / pass the drain gate")
    drain.add_argument("step", choices=["begin", "verify"])
    drain.add_argument("--restart", action="store_true", help="move the drain start to now")
    add("org-schema", _org_schema, "final sweep, adoption and receipt").add_argument(
        "--routing", required=True
    )
    wp = add("write-protocol", _control(bridge.enable_write_protocol), "enable generation 1")
    wp.add_argument("step", choices=["enable"])
    adm = add("admission", _admission, "enable (gated) or disable new V2 admission")
    adm.add_argument("state", choices=["enable", "disable"])
    own = add("default-owner", _default_owner, "owner of new runs outside any cohort")
    own.add_argument("owner", choices=sorted(_OWNERS))
    cohort = cmds.add_parser("cohort", help="cohort flags (org x Flow version x profile)")
    csub = cohort.add_subparsers(dest="step", required=True)
    cset = csub.add_parser("set", help="set the owner of new runs of one cohort")
    _db(cset)
    cset.add_argument("--org", required=True)
    cset.add_argument("--flow-version", required=True)
    cset.add_argument("--profile", required=True)
    cset.add_argument("--owner", required=True, choices=sorted(_OWNERS))
    cset.add_argument("--cohort", required=True, choices=[c.value for c in Cohort])
    cset.add_argument("--evidence", default=None, help="shadow comparison id (V2 needs one)")
    cset.set_defaults(func=_cohort_set)
    clist = csub.add_parser("list", help="cohort flags")
    _db(clist)
    clist.add_argument("--org", default=None)
    clist.set_defaults(func=_cohort_list)
    sh = add("shadow", _shadow, "shadow-compare a stored Flow version with its active plan")
    sh.add_argument("--org", required=True)
    sh.add_argument("--flow-version", required=True)
    sh.add_argument("--scenarios", required=True, help='JSON/YAML {"scenarios": [...]}')
    sh.add_argument("--view", default=None, help="metadata-view JSON for record lookups")
    rec = add("reconcile", _reconcile, "dual-ownership report (exit 1 unless zero)")
    rec.add_argument("--org", default=None)
    rec.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    add(
        "rollback-check", _rollback_check, "refuse a rollback target that is not bridge-capable"
    ).add_argument("--target", required=True, help="release version of the target binary")
    q = add("quarantine", _quarantine_clear, "clear an investigated quarantine")
    q.add_argument("step", choices=["clear"])
    q.add_argument("--reason", required=True, help="the current quarantine reason")

    release = groups.add_parser("release", help="§23 release evidence")
    rsub = release.add_subparsers(dest="command", required=True)
    ev = rsub.add_parser("evidence", help="evidence from authoritative state (exit 1 on a fail)")
    _db(ev)
    ev.add_argument("--head", default=None, help="reviewed head SHA")
    ev.add_argument("--expected-version", default=None, help="release every writer must run")
    ev.add_argument("--summary", action="store_true", help="one line per item")
    ev.set_defaults(func=_release_evidence)
