"""Generic transactional outbox: one store, one dispatcher, registered message families.

Used by the runtime's canonical ``runtime_outbox`` (family ``flow.effect.submit``, §10.7)
and the effect owner's ``owner_outbox`` (completion receipts, §15.2). See
:mod:`services.outbox.model` for the state machine, :mod:`services.outbox.store` for the
enqueue API and the fenced transitions, :mod:`services.outbox.families` for family
registration and the finalizer hook, :mod:`services.outbox.dispatcher` for delivery and
the repair sweep.
"""

from services.outbox.dispatcher import OutboxDispatcher, SweepReport
from services.outbox.families import (
    Deliverer,
    FamilyRegistry,
    FinalizationTicket,
    Finalizer,
    MessageFamily,
    Reconciler,
)
from services.outbox.hints import OutboxHint, claim_hinted_txn, hint_of
from services.outbox.model import (
    DUE_STATES,
    LIVE_STATES,
    PRE_FINAL_STATES,
    TERMINAL_STATES,
    AcceptedReceipt,
    Delivered,
    DeliveryPolicy,
    DeliveryResult,
    DeliveryState,
    Disposition,
    ReconcileResult,
    Refused,
    RejectedReceipt,
    RetryLater,
    Transition,
    UnknownReceipt,
)
from services.outbox.store import (
    EnqueueResult,
    NewOutboxMessage,
    OutboxMessage,
    OutboxTable,
    PendingEnqueue,
    PreClaim,
    count_by_state,
    enqueue_after,
    enqueue_settle,
    enqueue_txn,
    enqueue_write,
    get_message,
    list_messages,
    request_reconciliation_txn,
)

__all__ = [
    "DUE_STATES",
    "LIVE_STATES",
    "PRE_FINAL_STATES",
    "TERMINAL_STATES",
    "AcceptedReceipt",
    "Delivered",
    "Deliverer",
    "DeliveryPolicy",
    "DeliveryResult",
    "DeliveryState",
    "Disposition",
    "EnqueueResult",
    "FamilyRegistry",
    "FinalizationTicket",
    "Finalizer",
    "MessageFamily",
    "NewOutboxMessage",
    "OutboxDispatcher",
    "OutboxHint",
    "OutboxMessage",
    "OutboxTable",
    "PendingEnqueue",
    "PreClaim",
    "ReconcileResult",
    "Reconciler",
    "Refused",
    "RejectedReceipt",
    "RetryLater",
    "SweepReport",
    "Transition",
    "UnknownReceipt",
    "claim_hinted_txn",
    "count_by_state",
    "enqueue_after",
    "enqueue_settle",
    "enqueue_txn",
    "enqueue_write",
    "get_message",
    "hint_of",
    "list_messages",
    "request_reconciliation_txn",
]
