"""Admission, lanes, fairness and backpressure of the durable worker (§16).

Decisions are pure and live apart from I/O:

* :mod:`.budgets` — the ``admission`` section of the versioned runtime policy (§16.3):
  budgets per org, lane, profile, Flow, Flow version and object class, the reserved share
  and the pressure thresholds; the applicable bound of a subject;
* :mod:`.pressure` — §16.2 signals → one pressure level → how many new mutation
  admissions a pass may make (never below the reserved share of the cold lanes);
* :mod:`.scheduler` — deficit round-robin over orgs (fair as well as complete);
* :mod:`.controller` — the per-process controller the worker asks before it claims
  (before a business connection is acquired) and tells each outcome;
* :mod:`.slots` — per-key run concurrency limits as durable, fenced slots.

Import the submodules; this package re-exports nothing so the compiler can import
:mod:`.budgets` without pulling the kernel in.
"""

from __future__ import annotations

__all__: list[str] = []
