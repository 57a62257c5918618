"""The canonical Runtime outbox (§10.7): its table as a generic ``services.outbox``
table, the ``flow.effect.submit`` family (delivery to the designated effect owner,
acceptance reconciliation, Flow finalizer hook), and the EffectSubmit enqueue API.

Public API for the runtime-side effect work:

* :func:`effect_submit_intent` / :func:`enqueue_effect_submit_txn` — compute before the
  EffectSubmit transaction, enqueue last inside it (:mod:`runtime_svc.outbox.intent`);
* :func:`start_runtime_outbox` ``(cfg, engine, finalizer=...)`` — the dispatcher with the
  family registered; the finalizer implements ``services.outbox.Finalizer``
  (:mod:`runtime_svc.outbox.dispatch`);
* :data:`RUNTIME_OUTBOX` — the table spec for reads (``services.outbox.get_message``,
  ``list_messages``, ``count_by_state``).
"""

from runtime_svc.outbox.dispatch import (
    RuntimeOutbox,
    delivery_policy,
    flow_effect_submit_family,
    start_runtime_outbox,
)
from runtime_svc.outbox.handoff import EffectHandoff, envelope_of, owner_channels, receipt_matches
from runtime_svc.outbox.intent import (
    FAILURE_POLICIES,
    PAYLOAD_SCHEMA_VERSION,
    EffectSubmitIntent,
    effect_submit_intent,
    enqueue_effect_submit_txn,
)
from runtime_svc.outbox.table import RUNTIME_OUTBOX

__all__ = [
    "FAILURE_POLICIES",
    "PAYLOAD_SCHEMA_VERSION",
    "RUNTIME_OUTBOX",
    "EffectHandoff",
    "EffectSubmitIntent",
    "RuntimeOutbox",
    "delivery_policy",
    "effect_submit_intent",
    "enqueue_effect_submit_txn",
    "envelope_of",
    "flow_effect_submit_family",
    "owner_channels",
    "receipt_matches",
    "start_runtime_outbox",
]
