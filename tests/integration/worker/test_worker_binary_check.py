"""The runtime binary verifies a plan with the catalog before its first claim (§8.4,
V22.1-04): a binding-fingerprint (or entry, or generation) mismatch refuses the claim
before any mutation — no attempt, no business row — and a match lets the step run."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler.plan import ActionPin
from runtime_svc.definitions.inputs import CatalogSnapshot
from runtime_svc.kernel import FlowRunStateStore, RunState
from runtime_svc.schema import flow_step_attempts
from runtime_svc.worker import Outcome
from runtime_svc.worker.binary import BinaryCheck, Mismatch, plan_mismatches
from services.auth import TrustedRuntimeWorkScope
from services.errors import UnavailableError
from tests.integration.kernel.helpers import count
from tests.integration.worker.support import (
    _compile,
    flow_source,
    make_worker,
    run_records,
    seed,
    start_run,
)

PIN = ActionPin("core.format_name", "catalog-entry/v1:sha256:" + "a" * 64, "fp-1", "cap-1")


def _snapshot(plan: Any, *, digest: str | None = None, fingerprint: str = "fp-1") -> Any:
    return CatalogSnapshot(
        binding={},
        generation={
            "generation_id": plan.catalog.generation_id,
            "catalog_digest": digest or plan.catalog.catalog_digest,
        },
        entries=(
            {
                "action_type": PIN.action_type,
                "entry_digest": PIN.entry_digest,
                "binding_fingerprint": fingerprint,
            },
        ),
        metadata_view={},
    )


class StubCatalog:
    """The one ``CatalogPort`` call the binary check makes."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls = 0

    async def load_snapshot(
        self, scope: TrustedRuntimeWorkScope, generation_id: str, catalog_digest: str
    ) -> Any:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_plan_mismatches_name_each_reason() -> None:
    plan = dataclasses.replace(_compile("org-b", flow_source(1)), actions=(PIN,))
    assert plan_mismatches(plan, _snapshot(plan)) == []
    assert plan_mismatches(plan, _snapshot(plan, fingerprint="fp-2")) == [
        Mismatch(PIN.action_type, "binding_fingerprint_mismatch")
    ]
    other = _snapshot(plan, digest="catalog/v1:sha256:" + "f" * 64)
    assert Mismatch("", "generation_mismatch") in plan_mismatches(plan, other)
    empty = dataclasses.replace(_snapshot(plan), entries=())
    assert plan_mismatches(plan, empty) == [Mismatch(PIN.action_type, "entry_missing")]


async def test_a_mismatching_binary_never_claims_and_a_matching_one_runs(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    wrong = StubCatalog([_snapshot(seeded.plan, digest="catalog/v1:sha256:" + "0" * 64)])
    refusing = make_worker(engine, store, binary_check=BinaryCheck(wrong))  # type: ignore[arg-type]
    assert await refusing.run_batch(seeded.org) == [Outcome.NOT_ELIGIBLE]
    assert await refusing.run_batch(seeded.org) == [Outcome.NOT_ELIGIBLE]
    assert wrong.calls == 1  # one verdict per plan
    # Refused before the claim: no attempt, nothing mutated, the run still waits.
    assert await count(engine, flow_step_attempts, org_id=seeded.org) == 0
    assert await run_records(engine, seeded.org) == []
    assert (await store.get_run(seeded.org, run.flow_run_id)).state is RunState.RUNNABLE

    right = StubCatalog([UnavailableError("down"), _snapshot(seeded.plan)])
    checked = make_worker(engine, store, binary_check=BinaryCheck(right))  # type: ignore[arg-type]
    # An unreachable catalog refuses for now and is asked again next time.
    assert await checked.run_batch(seeded.org) == [Outcome.NOT_ELIGIBLE]
    # The verified run is claimed and runs (its later steps by continuation: same plan,
    # same verdict, no further catalog call).
    ran = await checked.run_batch(seeded.org)
    assert ran and set(ran) == {Outcome.COMMITTED}
    assert right.calls == 2


async def test_only_a_clear_cached_verdict_lets_a_worker_take_a_preclaimed_step(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    """The pre-claimed wake (ADR 0007) asks in memory: no verdict yet, a refusing one,
    or an uncached plan leave the step to the ordinary claim path, which checks first."""
    seeded = await seed(engine)
    await start_run(store, seeded)
    wrong = BinaryCheck(
        StubCatalog([_snapshot(seeded.plan, digest="catalog/v1:sha256:" + "0" * 64)])  # type: ignore[arg-type]
    )
    right = BinaryCheck(StubCatalog([_snapshot(seeded.plan)]))  # type: ignore[arg-type]
    assert not wrong.cleared(seeded.plan) and not right.cleared(seeded.plan)
    refusing = make_worker(engine, store, binary_check=wrong)
    assert refusing.preclaim_plan(seeded.org, seeded.plan_id) is None  # not cached
    await refusing.run_batch(seeded.org)
    assert not wrong.cleared(seeded.plan)
    assert refusing.preclaim_plan(seeded.org, seeded.plan_id) is None  # refused verdict
    checked = make_worker(engine, store, binary_check=right)
    await checked.run_batch(seeded.org)
    assert right.cleared(seeded.plan)
    assert checked.preclaim_plan(seeded.org, seeded.plan_id) is not None
