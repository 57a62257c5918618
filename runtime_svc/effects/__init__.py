"""The Flow side of external effects (§10.7, §10.8, §15): the ``EffectSubmit`` and
``EffectCompletion`` steps, the ``flow.effect.submit`` finalizer, and the effect sweep.

Modules (import them directly; this package re-exports only the pure contract):

* :mod:`.model` — identities, the frozen payload, receipt validation and routing (pure);
* :mod:`.links` — the immutable ``FlowEffectLink`` rows;
* :mod:`.steps` — the two steps in the worker (:class:`~.steps.EffectSteps`);
* :mod:`.finalizer` — the outbox family finalizer (:class:`~.finalizer.FlowEffectFinalizer`);
* :mod:`.sweep` — cancellation dispositions, repair and the expiry guard
  (:class:`~.sweep.EffectSweeper`);
* :mod:`.support` — the support read's effect correlation.

The lifecycle transitions themselves are the kernel's
(:mod:`runtime_svc.kernel.transitions_effects`); delivery is the canonical Runtime
outbox's (:mod:`runtime_svc.outbox`).
"""

from __future__ import annotations

from runtime_svc.effects.model import (
    MAX_EFFECT_PAYLOAD_BYTES,
    CompletionRoute,
    ConsumedReceipt,
    LinkRecord,
    PayloadError,
    ReceiptInvalid,
    Route,
    SubmitIdentities,
    effect_payload,
    route_completion,
    submit_identities,
    validate_receipt,
)

__all__ = [
    "MAX_EFFECT_PAYLOAD_BYTES",
    "CompletionRoute",
    "ConsumedReceipt",
    "LinkRecord",
    "PayloadError",
    "ReceiptInvalid",
    "Route",
    "SubmitIdentities",
    "effect_payload",
    "route_completion",
    "submit_identities",
    "validate_receipt",
]
