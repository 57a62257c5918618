"""Registered message families: what the generic dispatcher does with a message.

A :class:`MessageFamily` is the whole registration of one ``message_family`` value::

    MessageFamily(
        name="flow.effect.submit",
        deliver=...,      # async (OutboxMessage) -> Delivered | RetryLater | Refused
        reconcile=...,    # optional: async (OutboxMessage) -> Accepted/Rejected/Unknown/RetryLater
        finalizer=...,    # optional: converges the producer's state before terminal non-delivery
        policy=DeliveryPolicy(...),
    )

Families are registered on an explicit :class:`FamilyRegistry` handed to the dispatcher —
never a module-level mutable registry. A dispatcher claims only rows of the families it
has, so two processes serving different families can share one table.

**Finalizer hook** (§15.4). When reconciliation persisted a ``Rejected`` or ``Unknown``
owner receipt the message is in a pre-finalization state. The dispatcher (and the repair
sweep, for any candidate it finds) then calls ``await finalizer.finalize(ticket)``
*outside any transaction and without any outbox lock*. The finalizer opens its own
transaction, takes its own locks in its own order (the Flow's is root → steps →
dependency, §12), applies its convergence (fault path, terminal failure, quarantine) and,
*last in that same transaction*, calls ``await ticket.commit_txn(conn)``, which moves the
message to ``HandoffRejected``/``DeadLettered`` with a fenced update. Only then is the
message terminal. A finalizer that raises, or returns without calling ``commit_txn``,
leaves the message pre-final; the repair sweep calls it again, so it must be idempotent
(re-reading and finding its convergence already applied is the normal repeat case).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncConnection

from services.db import db_now
from services.outbox.model import (
    DeliveryPolicy,
    DeliveryResult,
    Disposition,
    ReconcileResult,
)
from services.outbox.store import OutboxMessage, OutboxTable, finalize_txn

__all__ = [
    "Deliverer",
    "FamilyRegistry",
    "FinalizationTicket",
    "Finalizer",
    "MessageFamily",
    "Reconciler",
]


#: Delivers one message to its consumer; never raises for transport failures (they are
#: :class:`~services.outbox.model.RetryLater`). Called outside any transaction.
Deliverer = Callable[[OutboxMessage], Awaitable[DeliveryResult]]

#: Asks the consumer's durable fence whether the message was accepted (§15.4).
Reconciler = Callable[[OutboxMessage], Awaitable[ReconcileResult]]


@dataclass(frozen=True)
class FinalizationTicket:
    """Handed to a :class:`Finalizer`: the pre-final message and the one write that makes
    it terminal, to be run last inside the finalizer's own transaction."""

    message: OutboxMessage
    disposition: Disposition
    spec: OutboxTable = field(repr=False)

    async def commit_txn(self, conn: AsyncConnection) -> OutboxMessage:
        """Fenced move to ``HandoffRejected`` (rejected) / ``DeadLettered`` (unknown).

        Raises:
            FenceLostError: another finalizer already finished this message; the caller's
                transaction must roll back (its convergence was applied by the winner).
        """
        return await finalize_txn(conn, self.spec, self.message, now=await db_now(conn))


class Finalizer(Protocol):
    """A family's convergence hook (see the module docstring)."""

    async def finalize(self, ticket: FinalizationTicket) -> None: ...


@dataclass(frozen=True)
class MessageFamily:
    """One registered message family."""

    name: str
    deliver: Deliverer
    reconcile: Reconciler | None = None
    finalizer: Finalizer | None = None
    policy: DeliveryPolicy = field(default_factory=DeliveryPolicy)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a message family needs a name")


class FamilyRegistry(Mapping[str, MessageFamily]):
    """An immutable set of families by name."""

    def __init__(self, families: Iterable[MessageFamily]) -> None:
        by_name: dict[str, MessageFamily] = {}
        for family in families:
            if family.name in by_name:
                raise ValueError(f"message family {family.name!r} registered twice")
            by_name[family.name] = family
        if not by_name:
            raise ValueError("a registry needs at least one family")
        self._families = by_name

    def __getitem__(self, name: str) -> MessageFamily:
        return self._families[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)
