"""``flowctl auth mint``: mint a workload credential from the configured signing key.

Without ``--org`` the credential is for the demo's *complete* work scope (org, app
installation, runtime capability, binding digest), read from ``$FLOW_DATA_DIR/demo.json``
— the summary ``make run`` writes — so the printed token works for every scoped RPC of
the demo stack. ``--org`` (with optional ``--app-installation``/``--capability``/
``--binding-digest``) mints for exactly the scope given instead. ``--role`` adds a role
(repeatable): ``flow.runs.cancel`` may cancel runs, ``flow.runs.delete`` may delete
them, ``flow.runs.operate`` may pause, resume, retry or restart them. The server still
refuses claims the signing key may not sign (its trusted-keys entry,
``services.auth.trust``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flowctl.common import CliError
from services.auth import OPERATOR_ROLES, WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceConfig, ServiceName, load_config

__all__ = ["demo_scope", "register"]

#: ``make run``'s summary of the seeded demo (``flowctl.demo.SUMMARY_FILE``).
_DEMO_SUMMARY = "demo.json"
_SCOPE_KEYS = ("org_id", "app_installation_id", "runtime_capability_id", "binding_digest")


def register(groups: Any) -> None:
    auth = groups.add_parser("auth", help="workload credentials")
    commands = auth.add_subparsers(dest="command", required=True)
    mint = commands.add_parser(
        "mint",
        help="print a signed, expiring credential",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    mint.add_argument(
        "--org",
        default=None,
        help="trusted org id (default: the complete work scope of the make-run demo)",
    )
    mint.add_argument(
        "--audience",
        action="append",
        choices=[s.value for s in ServiceName],
        help="service audience (repeatable; default: all three)",
    )
    mint.add_argument("--subject", default="operator", help="workload name")
    mint.add_argument("--app-installation", default=None)
    mint.add_argument("--capability", default=None)
    mint.add_argument("--binding-digest", default=None)
    mint.add_argument(
        "--role",
        action="append",
        choices=list(OPERATOR_ROLES),
        default=[],
        help="a role the credential carries (repeatable)",
    )
    mint.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    mint.set_defaults(func=_mint)


def demo_scope(cfg: ServiceConfig) -> tuple[str, str, str, str]:
    """``(org, installation, capability, binding digest)`` of the demo ``make run`` seeded.

    Raises:
        CliError: no readable demo summary under ``cfg.data_dir``.
    """
    path = Path(cfg.data_dir) / _DEMO_SUMMARY
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(
            f"no --org given and no demo summary at {path}: run `make run` first "
            "(or set FLOW_DATA_DIR to its data directory), or pass --org"
        ) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the demo summary {path}: {type(exc).__name__}") from exc
    values = [summary.get(k) if isinstance(summary, dict) else None for k in _SCOPE_KEYS]
    if not all(isinstance(v, str) and v for v in values):
        raise CliError(f"the demo summary {path} lacks {', '.join(_SCOPE_KEYS)}")
    org, inst, cap, digest = (str(v) for v in values)
    return org, inst, cap, digest


def _mint(args: argparse.Namespace) -> int:
    cfg = load_config(ServiceName.RUNTIME)
    audiences = tuple(ServiceName(a) for a in (args.audience or [s.value for s in ServiceName]))
    if args.org is None:
        if args.app_installation or args.capability or args.binding_digest:
            raise CliError("--app-installation/--capability/--binding-digest need --org")
        org, inst, cap, digest = demo_scope(cfg)
    else:
        org, inst, cap, digest = (
            args.org,
            args.app_installation,
            args.capability,
            (args.binding_digest),
        )
    try:
        claims = WorkloadClaims(
            subject=args.subject,
            audiences=audiences,
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            runtime_work_binding_digest=digest,
            roles=tuple(sorted(set(args.role))),
        )
    except ValueError as exc:
        raise CliError(f"invalid scope: {exc}") from exc
    key = load_signing_key(cfg.auth_signing_key)
    print(mint_credential(key, cfg.auth_signing_key_id, claims, ttl_s=args.ttl))
    return 0
