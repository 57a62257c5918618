"""Bounded Atomic (§9.2): one logical mutation step in one short owned transaction,
executed synchronously for ``StartRun`` within its API budget. See
:mod:`runtime_svc.atomic.runner`."""

from __future__ import annotations

from runtime_svc.atomic.runner import ATOMIC_QUEUE, AtomicRunner

__all__ = ["ATOMIC_QUEUE", "AtomicRunner"]
