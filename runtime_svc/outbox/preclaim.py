"""Which outbox dispatcher of this process takes pre-claimed ``flow.effect.submit``
messages (ADR 0004): the EffectSubmit transaction writes its outbox row already leased to
that dispatcher and, after the commit, hands the leased message over — no claim
transaction before ``AcceptHandoff``.

The step workers (``EffectSteps``) are built before the runtime's outbox dispatcher, and
only some processes run one (``FLOW_OUTBOX_DISPATCHERS=0``, supervised worker processes),
so the producer finds it at commit time by the database it writes: a dispatcher registers
itself for its engine while its loops run (:func:`register` / :func:`unregister`), and
:func:`dispatcher_for` answers None otherwise — the message is then enqueued ``Pending``
for polling, exactly as without this module. Registration is weak: a disposed engine or
a dropped dispatcher leaves nothing behind.
"""

from __future__ import annotations

import weakref

from sqlalchemy.ext.asyncio import AsyncEngine

from services.outbox import OutboxDispatcher

__all__ = ["dispatcher_for", "register", "unregister"]

_SERVING: weakref.WeakKeyDictionary[AsyncEngine, OutboxDispatcher] = weakref.WeakKeyDictionary()


def dispatcher_for(engine: AsyncEngine) -> OutboxDispatcher | None:
    """The runtime-outbox dispatcher serving ``engine`` in this process, if any."""
    return _SERVING.get(engine)


def register(engine: AsyncEngine, dispatcher: OutboxDispatcher) -> None:
    """``dispatcher``'s loops run for ``engine``: producers may pre-claim for it."""
    _SERVING[engine] = dispatcher


def unregister(engine: AsyncEngine, dispatcher: OutboxDispatcher) -> None:
    """``dispatcher`` stops: new messages are enqueued ``Pending`` again (a message it
    was handed and did not deliver is repaired after its lease, ADR 0004)."""
    if _SERVING.get(engine) is dispatcher:
        del _SERVING[engine]
