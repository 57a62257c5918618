"""The durable-workflow seam's Required Proof at every boundary of the effect exchange,
with the THREE services as real child processes (``tests/crash/flow_stack.py``) on
SQLite and MariaDB: a Contact starts the demo's ``WelcomeContact`` Flow, whose
``crm.send_email`` effect goes runtime → owner → provider → owner → runtime.

Each test SIGKILLs one child at a named ``FLOW_CRASH_AT`` point (it must die exactly
there — anything else is inconclusive and fails), restarts it without the hook, waits
(bounded, event-driven) for the run to end ``Succeeded``, and then counts on every side:
the runtime's step-entry counter (``FLOW_CRASH_STEP_ENTRY_FILE``), its canonical-outbox
rows, the owner's commands, and what the provider itself received (the SMTP sink's DATA
commands, or the HTTP receiver's requests and distinct effects).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.schema import external_commands
from runtime_svc.schema import flow_wake_signals, runtime_outbox
from services import db
from services.db import transaction
from services.outbox import DeliveryState
from services.proto import common_v1
from tests.crash.effects_support import effect_stack as _effect_stack
from tests.crash.effects_support import expect_sigkill
from tests.crash.flow_stack import FlowStack
from tests.support.dbs import migrated_database

pytestmark = pytest.mark.crash

_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]
_CONVERGE_S = 90.0
_SUCCEEDED = int(common_v1.RunState.RUN_STATE_SUCCEEDED)
SUBMIT, COMPLETION = "send_welcome#submit", "send_welcome#completion"


@pytest.fixture(params=_BACKENDS, ids=["sqlite", "mariadb"])
def dbs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    # Fresh databases per test: every test seeds the same demo org.
    with (
        migrated_database(request, tmp_path_factory, "catalog_svc") as catalog,
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
    ):
        yield catalog, runtime, owner


@pytest.fixture
async def runtime_engine(dbs: tuple[str, str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(dbs[1], pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def owner_engine(dbs: tuple[str, str, str]) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(dbs[2], pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def stack(tmp_path: Path, dbs: tuple[str, str, str]) -> AsyncIterator[FlowStack]:
    catalog, runtime, owner = dbs
    async with _effect_stack(tmp_path, owner, runtime) as effects:
        yield FlowStack(effects, catalog)


async def _until(what: str, predicate: Callable[[], Awaitable[bool]], stack: FlowStack) -> None:
    for _ in range(int(_CONVERGE_S / 0.1)):
        if await predicate():
            return
        for child in stack.effects.children:
            if child.proc.poll() not in (None, -9):
                pytest.fail(f"{child.name} exited {child.proc.returncode}:\n{child.log_text()}")
        await asyncio.sleep(0.1)
    logs = "\n".join(c.log_text()[-2500:] for c in stack.effects.children)
    pytest.fail(f"timed out waiting for {what}:\n{logs}")


async def _count(engine: AsyncEngine, table: object, org: str) -> int:
    t = table.c  # type: ignore[attr-defined]
    async with transaction(engine, readonly=True) as conn:
        stmt = select(func.count()).select_from(table).where(t.org_id == org)  # type: ignore[arg-type]
        return int((await conn.execute(stmt)).scalar_one())


async def _outbox_states(engine: AsyncEngine, org: str) -> list[str]:
    o = runtime_outbox.c
    async with transaction(engine, readonly=True) as conn:
        rows = await conn.execute(select(o.delivery_state).where(o.org_id == org))
        return [str(r[0]) for r in rows]


async def _up(stack: FlowStack, *, runtime: str | None = None, owner: str | None = None,
              runtime_env: dict[str, str] | None = None,
              **owner_env: str) -> tuple[object, object]:  # fmt: skip
    """Catalog, owner and runtime children (hooks as given), serving; the demo seeded."""
    catalog = stack.spawn_catalog()
    await catalog.wait_serving()
    owner_child = stack.spawn_owner(owner, **owner_env)
    runtime_child = stack.spawn_runtime(runtime, **(runtime_env or {}))
    await owner_child.wait_serving()
    await runtime_child.wait_serving()
    await stack.seed()
    return runtime_child, owner_child


async def _succeeded(stack: FlowStack, run_id: str) -> None:
    async def done() -> bool:
        state, _ = await stack.run_state(run_id)
        return state == _SUCCEEDED

    await _until(f"run {run_id} to succeed", done, stack)


async def _assert_once_on_every_side(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    assert stack.demo is not None
    org = stack.demo.org_id
    # Step-entry counter: the submit and the completion each entered exactly once.
    assert stack.entries(SUBMIT) == 1
    assert stack.entries(COMPLETION) == 1
    # The run can succeed before its outbox message is marked delivered: the completion
    # travels owner -> runtime on its own, while a message a dead dispatcher left
    # ``Delivering`` is only redelivered (and collapses at the owner's inbox) once its
    # lease has expired. Wait, bounded, for the row to settle; it must settle Delivered.
    delivered = [DeliveryState.DELIVERED.value]

    async def settled() -> bool:
        return await _outbox_states(runtime_engine, org) == delivered

    await _until("the outbox message to be marked delivered", settled, stack)
    assert await _outbox_states(runtime_engine, org) == delivered
    assert await _count(owner_engine, external_commands, org) == 1
    # One receipt, one wake signal consumed by the one completion.
    assert await _count(runtime_engine, flow_wake_signals, org) == 1


async def test_durable_seam_crash_after_the_submit_commit_before_dispatch_hands_off_once(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the EffectSubmit transaction committed, before the
    dispatcher delivered it — the restarted runtime delivers the committed message; the
    submit step is never entered again."""
    point = f"after_step_commit:{SUBMIT}"
    # The first runtime has no outbox dispatcher: otherwise its poll could claim the
    # committed message while the worker still waits for its COMMIT's answer (a commit is
    # visible before it is acknowledged) and race the kill; the window under test is
    # "committed, not yet dispatched", whoever would have dispatched it.
    runtime, _ = await _up(stack, runtime=point, runtime_env={"FLOW_OUTBOX_DISPATCHERS": "0"})
    run_id = await stack.create_contact("ada@example.com")
    await expect_sigkill(runtime, stack.effects.marker, point)  # type: ignore[arg-type]
    assert stack.demo is not None
    # Committed (Pending in the outbox), never handed off: the owner knows nothing.
    assert await _outbox_states(runtime_engine, stack.demo.org_id) == ["Pending"]
    assert await _count(owner_engine, external_commands, stack.demo.org_id) == 0
    assert stack.effects.sink.data_commands == 0
    assert stack.entries(SUBMIT) == 1

    restarted = stack.spawn_runtime()
    await restarted.wait_serving()
    await _succeeded(stack, run_id)

    await _assert_once_on_every_side(stack, runtime_engine, owner_engine)
    assert stack.effects.sink.data_commands == 1 and len(stack.effects.sink.received) == 1


async def test_durable_seam_crash_after_a_preclaimed_submit_commit_hands_off_once(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    """durable seam: crash after the EffectSubmit transaction committed its outbox
    message pre-claimed for this runtime's own dispatcher (ADR 0004), before the message
    was handed over — the row is ``Delivering`` under the dead process's lease, nobody
    claims it while the lease holds, and when it expires the restarted runtime's repair
    sweep returns it to ``Retrying`` (the lost attempt counted) and delivers it once; the
    submit step is never entered again."""
    point = f"after_step_commit:{SUBMIT}"
    runtime, _ = await _up(stack, runtime=point)
    run_id = await stack.create_contact("ada@example.com")
    await expect_sigkill(runtime, stack.effects.marker, point)  # type: ignore[arg-type]
    assert stack.demo is not None
    org = stack.demo.org_id
    assert await _outbox_states(runtime_engine, org) == [DeliveryState.DELIVERING.value]
    o = runtime_outbox.c
    async with transaction(runtime_engine, readonly=True) as conn:
        row = (await conn.execute(select(runtime_outbox).where(o.org_id == org))).mappings().one()
    assert row["lease_token"] and row["delivery_attempts"] == 0  # leased, never attempted
    assert await _count(owner_engine, external_commands, org) == 0
    assert stack.effects.sink.data_commands == 0
    assert stack.entries(SUBMIT) == 1

    restarted = stack.spawn_runtime()
    await restarted.wait_serving()
    await _succeeded(stack, run_id)

    await _assert_once_on_every_side(stack, runtime_engine, owner_engine)
    async with transaction(runtime_engine, readonly=True) as conn:
        row = (await conn.execute(select(runtime_outbox).where(o.org_id == org))).mappings().one()
    assert row["delivery_attempts"] == 2  # the dead process's lease, then the delivery
    assert stack.effects.sink.data_commands == 1 and len(stack.effects.sink.received) == 1


async def test_durable_seam_crash_after_owner_acceptance_before_delivered_resumes_once(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    """durable seam: the runtime's dispatcher dies after the owner durably accepted the
    handoff and before it marked the message delivered — its redelivery collapses into
    the one command."""
    point = "after_outbox_delivery:flow.effect.submit"
    runtime, _ = await _up(stack, runtime=point)
    run_id = await stack.create_contact("ada@example.com")
    await expect_sigkill(runtime, stack.effects.marker, point)  # type: ignore[arg-type]
    assert stack.demo is not None
    assert await _outbox_states(runtime_engine, stack.demo.org_id) == ["Delivering"]
    assert await _count(owner_engine, external_commands, stack.demo.org_id) == 1

    restarted = stack.spawn_runtime()
    await restarted.wait_serving()
    await _succeeded(stack, run_id)

    await _assert_once_on_every_side(stack, runtime_engine, owner_engine)
    assert stack.effects.sink.data_commands == 1 and len(stack.effects.sink.received) == 1


async def test_durable_seam_crash_after_the_provider_accepted_resumes_on_one_effect(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    """durable seam: the owner dies after the provider applied the effect and before it
    recorded the outcome — the restarted owner replays with the same provider
    idempotency key (an HTTP receiver that honours ``Idempotency-Key`` serves the
    ``email.smtp`` kind here: providers are owner configuration) and the receiver applies
    one effect; the Flow resumes once."""
    point = "after_provider_accepted:email.smtp"
    webhook = {
        "FLOW_EFFECT_PROVIDERS": "email.smtp=webhook",
        "FLOW_EFFECT_WEBHOOK_IDEMPOTENT": "true",
    }
    _, owner = await _up(stack, owner=point, **webhook)
    run_id = await stack.create_contact("ada@example.com")
    await expect_sigkill(owner, stack.effects.marker, point)  # type: ignore[arg-type]
    receiver = stack.effects.receiver
    assert len(receiver.requests) == 1 and len(receiver.effects) == 1

    restarted = stack.spawn_owner(**webhook)
    await restarted.wait_serving()
    await _succeeded(stack, run_id)

    await _assert_once_on_every_side(stack, runtime_engine, owner_engine)
    # Sent twice with one key, applied once.
    assert len(receiver.requests) == 2 and len({r["key"] for r in receiver.requests}) == 1
    assert len(receiver.effects) == 1
    assert receiver.requests[0]["body"]["to"] == "ada@example.com"


async def test_durable_seam_crash_after_the_receipt_commit_wakes_and_resumes_once(
    stack: FlowStack, runtime_engine: AsyncEngine, owner_engine: AsyncEngine
) -> None:
    """durable seam: the owner dies after its completion receipt (and outbox message)
    committed, before delivering it — the restarted owner delivers it; one wake, one
    resume."""
    point = "after_receipt_commit:email.smtp"
    _, owner = await _up(stack, owner=point)
    run_id = await stack.create_contact("ada@example.com")
    await expect_sigkill(owner, stack.effects.marker, point)  # type: ignore[arg-type]
    assert stack.demo is not None
    assert stack.effects.sink.data_commands == 1
    assert await _count(runtime_engine, flow_wake_signals, stack.demo.org_id) == 0
    assert stack.entries(COMPLETION) == 0

    restarted = stack.spawn_owner()
    await restarted.wait_serving()
    await _succeeded(stack, run_id)

    await _assert_once_on_every_side(stack, runtime_engine, owner_engine)
    assert stack.effects.sink.data_commands == 1 and len(stack.effects.sink.received) == 1
