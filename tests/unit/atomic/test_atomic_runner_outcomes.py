"""``AtomicRunner`` keeps a bounded record of attempt outcomes (issue 10, item 14): a
long-lived runtime process must not grow a list per attempt for ever."""

from __future__ import annotations

from runtime_svc.atomic import AtomicRunner
from runtime_svc.kernel import FlowRunStateStore
from runtime_svc.worker import FixedViews, Outcome
from services import db
from tests.integration.worker.support import record_view


def test_outcomes_keep_only_the_latest_and_counts_keep_all() -> None:
    engine = db.create_engine("sqlite+aiosqlite://")  # never connected: no I/O here
    store = FlowRunStateStore(engine)
    runner = AtomicRunner(engine, store, FixedViews(record_view()), max_recent=3)
    for outcome in [Outcome.RETRY_SCHEDULED] * 5 + [Outcome.COMMITTED]:
        runner._record(outcome)
    assert runner.outcomes == [
        Outcome.RETRY_SCHEDULED,
        Outcome.RETRY_SCHEDULED,
        Outcome.COMMITTED,
    ]
    assert runner.counts == {Outcome.RETRY_SCHEDULED: 5, Outcome.COMMITTED: 1}
