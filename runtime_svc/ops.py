"""Operator operations on the runtime database: ``python -m runtime_svc.ops``.

An operator reconciles a commit-unknown quarantine here, with the runtime's own
database settings (``FLOW_RUNTIME_DB_URL``; on a cluster any node — reads are causal),
or — for ``retry`` — through the role-checked, request-deduplicated
``FlowRunService.RetryQuarantinedRun`` (``flowctl run retry-quarantined``). Both take
the same store path (:func:`runtime_svc.kernel.store_reconcile.reconcile_quarantine_txn`)
with the same refusals (including ``effect_outcome_unknown``) and audit record; ``fail``
is offered here only::

    python -m runtime_svc.ops quarantine show  --org ORG --run RUN
    python -m runtime_svc.ops quarantine retry --org ORG --run RUN --operator alice --reason INC-42
    python -m runtime_svc.ops quarantine fail  --org ORG --run RUN --operator alice --reason INC-42

``show`` prints the run state and the marker (JSON); ``retry`` and ``fail`` read the
marker again under the run's locks and apply the decision with an audit record
(:mod:`runtime_svc.kernel.store_reconcile`).

The principal directory (§17.2, :class:`runtime_svc.identity.PrincipalDirectory`) is
maintained here by the org's identity sync or an operator — ids and grant names only,
stored as a digest; never a credential::

    python -m runtime_svc.ops principal show    --org ORG --principal user-ann
    python -m runtime_svc.ops principal put     --org ORG --principal user-ann --grant Case.read ...
    python -m runtime_svc.ops principal disable --org ORG --principal user-ann
    python -m runtime_svc.ops principal enable  --org ORG --principal user-ann

The org's versioned runtime policy (§16.3: the compiler's bounds, the wait policy and the
``admission`` budgets, ``docs/operations.md`` §8) is read and published here; a published
document is validated in full first (an invalid one is refused with the offending field,
nothing is written), an unchanged one publishes nothing, and a changed one becomes the
next immutable generation — new activations compile against it and admission reads it
within its cache period::

    python -m runtime_svc.ops policy show    --org ORG
    python -m runtime_svc.ops policy publish --org ORG --file policy.json   # or --file - (stdin)

Exit codes: 0 done, 1 refused or not found (the reason code is printed), 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.definitions.policy_store import PolicyStore
from runtime_svc.identity import PrincipalDirectory
from runtime_svc.kernel.reconcile import Resolution
from runtime_svc.kernel.store_reconcile import inspect_quarantine, reconcile_quarantine
from runtime_svc.worker.settings import WorkerSettings
from services import db
from services.config import ConfigError, ServiceName, load_config
from services.errors import FlowError, NotFoundError

__all__ = ["main"]


async def _principal(engine: AsyncEngine, args: argparse.Namespace) -> dict[str, object]:
    directory = PrincipalDirectory(engine)
    if args.action == "show":
        state = await directory.get(args.org, args.principal)
        if state is None:
            raise NotFoundError("flow_principal", args.principal)
    elif args.action == "put":
        state = await directory.put(
            args.org, args.principal, enabled=not args.disabled, grants=args.grant
        )
    else:
        state = await directory.set_enabled(args.org, args.principal, args.action == "enable")
    return {
        "principal_id": state.principal_id,
        "status": state.status.value,
        "permission_digest": state.permission_digest,
    }


async def _policy(
    engine: AsyncEngine, args: argparse.Namespace, document: Mapping[str, Any] | None
) -> dict[str, object]:
    policies = PolicyStore(engine)
    before = await policies.current(args.org)
    after = before if document is None else await policies.put(args.org, document)
    out: dict[str, object] = {
        "org_id": after.org_id,
        "version": after.version,
        "document_digest": after.document_digest,
        "document": dict(after.document),
    }
    if document is not None:
        out["published"] = after.version != before.version
    return out


def _policy_document(path: str) -> dict[str, Any]:
    """The JSON object in ``path`` (``-``: stdin).

    Raises:
        ValueError: unreadable, not JSON, or not an object.
    """
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the policy document {path}: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the policy document {path} is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"the policy document {path} must be a JSON object")
    return document


async def _run(
    args: argparse.Namespace,
    db_url: str,
    max_attempts: int,
    document: Mapping[str, Any] | None = None,
) -> dict[str, object]:
    engine = db.create_engine(db_url, pool_size=1)
    try:
        if args.group == "principal":
            return await _principal(engine, args)
        if args.group == "policy":
            return await _policy(engine, args, document)
        if args.action == "show":
            return (await inspect_quarantine(engine, args.org, args.run)).as_dict()
        result = await reconcile_quarantine(
            engine,
            args.org,
            args.run,
            Resolution(args.action),
            operator=args.operator,
            reason=args.reason,
            max_attempts=max_attempts,
        )
        return {
            **result.report.as_dict(),
            "resolution": result.resolution.value,
            "run_state": result.run_state.name,
        }
    finally:
        await engine.dispose()


def main(argv: Sequence[str] | None = None, *, db_url: str | None = None) -> int:
    """Parse ``argv`` and run one operation; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m runtime_svc.ops")
    groups = parser.add_subparsers(dest="group", required=True)
    quarantine = groups.add_parser("quarantine", help="reconcile a commit-unknown quarantine")
    actions = quarantine.add_subparsers(dest="action", required=True)
    for name, text in (
        ("show", "print the run and its marker"),
        (Resolution.RETRY.value, "retry the step from its input checkpoint"),
        (Resolution.FAIL.value, "fail the run terminally"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("--org", required=True)
        action.add_argument("--run", required=True)
        if name != "show":
            action.add_argument("--operator", required=True, help="who decides (audited)")
            action.add_argument("--reason", required=True, help="reason code or ticket")
    principal = groups.add_parser("principal", help="the principal directory (§17.2)")
    verbs = principal.add_subparsers(dest="action", required=True)
    for name, text in (
        ("show", "print a principal's status and permission digest"),
        ("put", "register or update a principal and its grants"),
        ("disable", "disable a principal (its runs' next steps are denied)"),
        ("enable", "enable a principal again"),
    ):
        verb = verbs.add_parser(name, help=text)
        verb.add_argument("--org", required=True)
        verb.add_argument("--principal", required=True)
        if name == "put":
            verb.add_argument(
                "--grant", action="append", default=[], help="permission/FLS/RLS grant name"
            )
            verb.add_argument("--disabled", action="store_true", help="register it disabled")
    policy = groups.add_parser("policy", help="the org's versioned runtime policy (§16.3)")
    policy_verbs = policy.add_subparsers(dest="action", required=True)
    for name, text in (
        ("show", "print the org's newest policy generation"),
        ("publish", "validate a policy document and publish it as the next generation"),
    ):
        verb = policy_verbs.add_parser(name, help=text)
        verb.add_argument("--org", required=True)
        if name == "publish":
            verb.add_argument("--file", required=True, help="the JSON document (- for stdin)")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    document = None
    if args.group == "policy" and args.action == "publish":
        try:
            document = _policy_document(args.file)
        except ValueError as exc:
            sys.stderr.write(f"{exc}\n")
            return 2
    try:
        cfg = load_config(ServiceName.RUNTIME)
        url = db_url if db_url is not None else cfg.db_url
        max_attempts = WorkerSettings.from_config(cfg).max_attempts
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"configuration error: {exc}\n")
        return 2
    try:
        out = asyncio.run(_run(args, url, max_attempts, document))
    except FlowError as exc:
        sys.stderr.write(f"{exc.reason}: {exc}\n")
        return 1
    sys.stdout.write(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
