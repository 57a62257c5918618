"""The worker's quarantine after a lost business COMMIT opens a new connection; one lost
*before* the quarantine's own COMMIT (a failed node still being routed around) wrote
nothing and is tried again, bounded; anything else is not."""

from __future__ import annotations

from typing import Any

import pymysql
import pytest

from runtime_svc.kernel import AttemptOutcome
from runtime_svc.kernel.decisions import AlreadyCommitted
from runtime_svc.worker import Outcome, StepWorker
from services.errors import CommitOutcomeUnknownError

LOST = pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")


class _Store:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    async def quarantine_commit_unknown(self, org_id: str, fence: Any, outcome: Any) -> Any:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return AlreadyCommitted()


class _Fence:
    step_execution_id = "step_1"


def _worker(store: _Store) -> StepWorker:
    worker = object.__new__(StepWorker)
    worker.store = store  # type: ignore[assignment]
    return worker


async def test_a_connection_lost_before_the_quarantine_commit_is_tried_again() -> None:
    store = _Store([LOST, LOST])
    outcome = await _worker(store)._quarantine(
        "org-1",
        _Fence(),
        AttemptOutcome.COMMIT_UNKNOWN,  # type: ignore[arg-type]
    )
    assert (outcome, store.calls) == (Outcome.ALREADY_COMMITTED, 3)


async def test_the_retries_are_bounded() -> None:
    store = _Store([LOST, LOST, LOST, LOST])
    with pytest.raises(pymysql.err.OperationalError):
        await _worker(store)._quarantine(
            "org-1",
            _Fence(),
            AttemptOutcome.COMMIT_UNKNOWN,  # type: ignore[arg-type]
        )
    assert store.calls == 3


@pytest.mark.parametrize(
    "error",
    [CommitOutcomeUnknownError("lost during commit"), ValueError("a bug")],
    ids=["commit-unknown", "other"],
)
async def test_other_errors_are_not_retried(error: BaseException) -> None:
    store = _Store([error])
    with pytest.raises(type(error)):
        await _worker(store)._quarantine(
            "org-1",
            _Fence(),
            AttemptOutcome.COMMIT_UNKNOWN,  # type: ignore[arg-type]
        )
    assert store.calls == 1
