"""The support read's effect correlation (§19): each immutable ``FlowEffectLink`` of a
run with the canonical Runtime outbox delivery state of its message — read from the
authoritative rows, org-scoped, never from logs."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.effects.links import links_of_run_txn
from runtime_svc.effects.model import LinkRecord
from runtime_svc.outbox import RUNTIME_OUTBOX
from services.outbox import DeliveryState, get_message

__all__ = ["EffectSupport", "effect_support_txn"]


@dataclass(frozen=True)
class EffectSupport:
    """One link and its message's delivery state (``None``: the message is gone)."""

    link: LinkRecord
    delivery_state: DeliveryState | None


async def effect_support_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str
) -> list[EffectSupport]:
    """Every effect of ``(org_id, flow_run_id)``, by link id."""
    out = []
    for link in await links_of_run_txn(conn, org_id, flow_run_id):
        message = await get_message(conn, RUNTIME_OUTBOX, org_id, link.runtime_outbox_message_id)
        out.append(EffectSupport(link, None if message is None else message.delivery_state))
    return out
