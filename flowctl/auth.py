"""``flowctl auth mint``: mint a workload credential from the configured signing key."""

from __future__ import annotations

import argparse
from typing import Any

from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName, load_config

__all__ = ["register"]


def register(groups: Any) -> None:
    auth = groups.add_parser("auth", help="workload credentials")
    commands = auth.add_subparsers(dest="command", required=True)
    mint = commands.add_parser("mint", help="print a signed, expiring credential")
    mint.add_argument("--org", required=True, help="trusted org id")
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
    mint.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    mint.set_defaults(func=_mint)


def _mint(args: argparse.Namespace) -> int:
    cfg = load_config(ServiceName.RUNTIME)
    audiences = tuple(ServiceName(a) for a in (args.audience or [s.value for s in ServiceName]))
    claims = WorkloadClaims(
        subject=args.subject,
        audiences=audiences,
        org_id=args.org,
        app_installation_id=args.app_installation,
        runtime_capability_id=args.capability,
        runtime_work_binding_digest=args.binding_digest,
    )
    key = load_signing_key(cfg.auth_signing_key)
    print(mint_credential(key, cfg.auth_signing_key_id, claims, ttl_s=args.ttl))
    return 0
