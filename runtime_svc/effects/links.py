"""``FlowEffectLink`` rows (§10.8): immutable lineage from a Flow step to its effect.

The link is written once, last in the ``EffectSubmit`` transaction (after the outbox
enqueue), and never updated: it is not a second effect-state machine. Remote outcome is
read from the owner's receipt; delivery state from the canonical Runtime outbox. Every
read is scoped by the complete work scope (or, for a run's support read, by org and
run); a link of another scope is invisible.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.effects.model import LinkRecord
from runtime_svc.kernel.wait_model import WorkScopeKey
from runtime_svc.schema import flow_effect_links
from services.db import WORK_SCOPE, insert_if_absent, insert_statement, scoped_select
from services.db_batch import Write
from services.errors import ConflictError

__all__ = ["insert_link_txn", "link_by_key_txn", "link_insert", "links_of_run_txn"]

_IMMUTABLE = (
    "effect_link_id",
    "flow_run_id",
    "step_execution_id",
    "effect_owner_kind",
    "runtime_outbox_message_id",
    "submission_attempt_id",
)


#: The link of a handoff key in exactly a work scope (bound per call).
_LINK_BY_KEY = scoped_select(flow_effect_links, (*WORK_SCOPE[1:], "effect_handoff_key"))


def _link(row: RowMapping) -> LinkRecord:
    return LinkRecord(**{f: row[f] for f in LinkRecord.__dataclass_fields__})


_INSERT_LINK = insert_statement(flow_effect_links)


def _values(link: LinkRecord, now: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {f: getattr(link, f) for f in LinkRecord.__dataclass_fields__}
    values["created_at"] = now  # the transaction's database time, never the caller's
    return values


def link_insert(link: LinkRecord, now: datetime) -> Write:
    """The link's INSERT as the last write of the ``EffectSubmit`` transaction's round
    trip, after its new outbox message (``services.outbox.enqueue_after``): dependency,
    message and link are written together, so a link row already under the key with a
    new message and dependency is a conflict, never a retry (a retry's dependency
    INSERT fails first)."""

    def taken() -> ConflictError:
        return ConflictError(
            "the handoff key already has an effect link",
            entity="flow_effect_links",
            key=link.effect_link_id,
        )

    return Write(_INSERT_LINK, _values(link, now), on_duplicate=taken)


async def insert_link_txn(conn: AsyncConnection, link: LinkRecord, now: datetime) -> bool:
    """Insert ``link`` in the caller's ``EffectSubmit`` transaction (last, §15.1 step 4).

    Returns:
        False when the same link exists already (a retry of the same submit).

    Raises:
        ConflictError: the handoff key already has a *different* link.
    """
    if await insert_if_absent(conn, flow_effect_links, _values(link, now)):
        return True
    scope = WorkScopeKey(
        link.org_id,
        link.app_installation_id,
        link.runtime_capability_id,
        link.runtime_work_binding_digest,
    )
    existing = await link_by_key_txn(conn, scope, link.effect_handoff_key)
    if existing is None or any(getattr(existing, f) != getattr(link, f) for f in _IMMUTABLE):
        raise ConflictError(
            "the handoff key already has another effect link",
            entity="flow_effect_links",
            key=link.effect_link_id,
        )
    return False


async def link_by_key_txn(
    conn: AsyncConnection, scope: WorkScopeKey, handoff_key: str
) -> LinkRecord | None:
    """The link of ``handoff_key`` in exactly ``scope`` (no lock)."""
    params = {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
        "effect_handoff_key": handoff_key,
    }
    row = (await conn.execute(_LINK_BY_KEY, params)).mappings().first()
    return None if row is None else _link(row)


async def links_of_run_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str
) -> list[LinkRecord]:
    """Every link of ``(org_id, flow_run_id)``, by link id (the support read)."""
    c = flow_effect_links.c
    rows = (
        (
            await conn.execute(
                select(flow_effect_links)
                .where(c.org_id == org_id, c.flow_run_id == flow_run_id)
                .order_by(c.effect_link_id)
            )
        )
        .mappings()
        .all()
    )
    return [_link(r) for r in rows]
