"""Direct claims of just-committed outbox messages (the wakeup's *hint*, see
:mod:`services.background`).

A producer that enqueues a message in its transaction notifies the dispatcher's
:class:`~services.background.Wakeup` after that commit with an :class:`OutboxHint` — the
message's table and full primary key. The woken delivery loop then claims exactly that
row in ONE transaction (:func:`claim_hinted_txn`: read it by key, then the ordinary
fenced claim) instead of a discovery transaction over every org followed by the claim:
one transaction and the org scan less on the latency path of every handoff.

A hint is only a shortcut: it carries no state, the claim re-validates everything
(family served here, due state, due time, version) under the same compare-and-swap as a
discovered claim, and a hint that is lost, stale, for a message already claimed (by
polling or another process) or for a row that never committed (the producer's COMMIT
failed) claims nothing. Polling stays the guarantee.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Select, bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from services.outbox.store import OutboxMessage, OutboxTable, _due, _message, _org, claim_txn

__all__ = ["OutboxHint", "claim_hinted_txn", "hint_of"]


class _Keyed(Protocol):
    """What names a message's row: its org, scope columns and id (a new or a stored
    message)."""

    @property
    def org_id(self) -> str: ...

    @property
    def message_id(self) -> str: ...


@dataclass(frozen=True)
class OutboxHint:
    """A committed message, by its table and full primary key."""

    table: str
    org_id: str
    key: tuple[tuple[str, Any], ...]


def hint_of(spec: OutboxTable, message: _Keyed) -> OutboxHint:
    """The hint naming ``message`` (a :class:`~services.outbox.NewOutboxMessage` just
    enqueued, or a stored :class:`OutboxMessage`) in ``spec``'s table."""
    key = {c: getattr(message, c) for c in spec.pk_scope_columns if c != "org_id"}
    key[spec.id_column] = message.message_id
    return OutboxHint(spec.table.name, message.org_id, tuple(sorted(key.items())))


@functools.cache
def _hinted_stmt(spec: OutboxTable, key: tuple[str, ...], families: tuple[str, ...]) -> Select[Any]:
    """The hinted row by its primary key, when due for ``families`` (built once per
    table, key columns and family set)."""
    t = spec.table
    named = [t.c[k] == bindparam(f"k_{k}", type_=t.c[k].type) for k in key]
    return select(t).where(_org(spec), *named, *_due(spec, families))


async def claim_hinted_txn(
    conn: AsyncConnection,
    spec: OutboxTable,
    hint: OutboxHint,
    leases: Mapping[str, int],
    *,
    owner: str,
    now: datetime,
) -> OutboxMessage | None:
    """Lease the hinted message when it is due for one of the families of ``leases``
    (family → lease in ms; read by primary key, then
    :func:`~services.outbox.store.claim_txn`'s fenced claim with that family's lease).

    Returns:
        None when the row is absent, of another family or not due (nothing written).

    Raises:
        FenceLostError: another dispatcher claimed (or changed) the row first.
    """
    if hint.table != spec.table.name:
        return None
    stmt = _hinted_stmt(spec, tuple(k for k, _ in hint.key), tuple(sorted(leases)))
    params = {"org_id": hint.org_id, "now": now, **{f"k_{k}": v for k, v in hint.key}}
    row = (await conn.execute(stmt, params)).mappings().first()
    if row is None:
        return None
    message = _message(spec, row)
    until = now + timedelta(milliseconds=leases[message.family])
    return await claim_txn(conn, spec, message, owner=owner, lease_until=until, now=now)
