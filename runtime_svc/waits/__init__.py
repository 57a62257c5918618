"""Durable waits (§10.5, §10.6, §14): the producer registry, producer-side and
dependency-side matching, the record-change producer, the ``DependencyWait`` step, the
signal service, and the bounded reconciler / expiry / repair sweeps.

Modules (import them directly; this package only re-exports the pure contract, so the
compiler, definitions and kernel can use it without import cycles):

* :mod:`.registry` — producer kinds and their published contract (pure);
* :mod:`.evidence` — validation of a submitted notification (pure);
* :mod:`.queries` — non-locking discovery reads and bookkeeping writes;
* :mod:`.resolution` — matching evidence to dependencies (:class:`Matcher`);
* :mod:`.signals` — ``SubmitWakeSignal``/``GetWakeSignal`` behaviour;
* :mod:`.record_producer` — the record engine's same-transaction signals;
* :mod:`.steps` — entering and resuming a ``DependencyWait`` step in the worker;
* :mod:`.reconciler` — the bounded periodic reconciler, expiry, repair, retention;
* :mod:`.support` — the support read's dependency correlation, the consumed signal;
* :mod:`.runtime` — one process's wiring (:class:`WaitRuntime`).

The state transitions themselves (resolution, expiry, cancellation, repair; root →
step → dependency → signal) live in the kernel (:mod:`runtime_svc.kernel.store_waits`,
:mod:`runtime_svc.kernel.transitions_waits`), the only writer of lifecycle rows.
"""

from __future__ import annotations

from runtime_svc.waits.evidence import (
    EFFECT_EVIDENCE_FIELDS,
    EFFECT_OUTCOMES,
    EVIDENCE_DIGEST_KIND,
    MAX_EVIDENCE_BYTES,
    SignalSubmission,
    evidence_digest,
    validate_submission,
)
from runtime_svc.waits.registry import (
    DEFAULT_SIGNAL_KINDS,
    SIGNAL_SUBMIT_ROLE,
    ProducerFamily,
    ProducerIssue,
    ProducerRegistry,
    ProducerSpec,
)

__all__ = [
    "DEFAULT_SIGNAL_KINDS",
    "EFFECT_EVIDENCE_FIELDS",
    "EFFECT_OUTCOMES",
    "EVIDENCE_DIGEST_KIND",
    "MAX_EVIDENCE_BYTES",
    "SIGNAL_SUBMIT_ROLE",
    "ProducerFamily",
    "ProducerIssue",
    "ProducerRegistry",
    "ProducerSpec",
    "SignalSubmission",
    "evidence_digest",
    "validate_submission",
]
