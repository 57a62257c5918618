"""The operator read path of a service's outbox: ``python -m <svc> outbox …``.

::

    python -m runtime_svc outbox counts --org org-demo
    python -m runtime_svc outbox list --org org-demo --state DeadLettered --state AcceptanceUnknown
    python -m effect_owner_svc outbox show --org org-demo --id oom_…

Every read is scoped by the org given (§10.0: no read crosses orgs) and prints one JSON
object per line: identities, family, key, delivery state, attempts, lease, safe error
code and timestamps — never the payload (only its digest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from services.db import create_engine, transaction
from services.outbox.model import DeliveryState
from services.outbox.store import (
    OutboxMessage,
    OutboxTable,
    count_by_state,
    get_message,
    list_messages,
)

__all__ = ["main", "message_summary"]


def message_summary(m: OutboxMessage) -> dict[str, Any]:
    """The safe operator view of a message (no payload)."""

    def ts(v: Any) -> str | None:
        return None if v is None else v.isoformat()

    return {
        "org_id": m.org_id,
        "app_installation_id": m.app_installation_id,
        "runtime_capability_id": m.runtime_capability_id,
        "runtime_work_binding_digest": m.runtime_work_binding_digest,
        "message_id": m.message_id,
        "family": m.family,
        "key": m.key,
        "payload_digest": m.payload_digest,
        "delivery_state": m.delivery_state.value,
        "delivery_attempts": m.delivery_attempts,
        "next_attempt_at": ts(m.next_attempt_at),
        "lease_owner": m.lease_owner,
        "lease_until": ts(m.lease_until),
        "last_error_code": m.last_error_code,
        "delivered_at": ts(m.delivered_at),
        "deadline": ts(m.deadline),
        "created_at": ts(m.created_at),
        "updated_at": ts(m.updated_at),
        "state_version": m.state_version,
    }


async def _run(args: argparse.Namespace, spec: OutboxTable, db_url: str) -> int:
    engine = create_engine(db_url, pool_size=1)
    out = sys.stdout
    try:
        async with transaction(engine, readonly=True) as conn:
            if args.action == "counts":
                counts = await count_by_state(conn, spec, args.org)
                out.write(json.dumps({"org_id": args.org, "counts": counts}, sort_keys=True) + "\n")
                return 0
            if args.action == "show":
                found = await get_message(conn, spec, args.org, args.id)
                if found is None:
                    sys.stderr.write(f"no outbox message {args.id} in org {args.org}\n")
                    return 1
                out.write(json.dumps(message_summary(found), sort_keys=True) + "\n")
                return 0
            states = [DeliveryState(s) for s in args.state or ()]
            page = await list_messages(
                conn,
                spec,
                args.org,
                states=states,
                family=args.family,
                after_id=args.after,
                limit=args.limit,
            )
            for m in page:
                out.write(json.dumps(message_summary(m), sort_keys=True) + "\n")
            return 0
    finally:
        await engine.dispose()


def main(argv: Sequence[str], service_pkg: str, spec: OutboxTable, db_url: str) -> int:
    """``outbox counts|list|show`` for one service; returns the exit code (2 = usage)."""
    parser = argparse.ArgumentParser(prog=f"python -m {service_pkg} outbox")
    actions = parser.add_subparsers(dest="action", required=True)
    counts = actions.add_parser("counts", help="messages per delivery state of one org")
    counts.add_argument("--org", required=True)
    listing = actions.add_parser("list", help="messages of one org, by message id")
    listing.add_argument("--org", required=True)
    listing.add_argument(
        "--state", action="append", choices=[s.value for s in DeliveryState], help="repeatable"
    )
    listing.add_argument("--family")
    listing.add_argument("--after", help="keyset: list message ids after this one")
    listing.add_argument("--limit", type=int, default=50)
    show = actions.add_parser("show", help="one message of one org")
    show.add_argument("--org", required=True)
    show.add_argument("--id", required=True)
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return asyncio.run(_run(args, spec, db_url))
