"""The persisted principal directory (``flow_principals``) and its ops CLI, on SQLite
and MariaDB: org-scoped, fenced, digests only; the reauthorization cache's staleness
bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc import ops
from runtime_svc.identity import (
    PrincipalStatus,
    authorization_context_digest,
    permission_digest,
)
from runtime_svc.kernel import RunState
from services.errors import InvalidArgumentError, NotFoundError
from tests.integration.identity.support import ANN, GRANTS, IdentityWorld, two_step_flow
from tests.integration.waits.support import new_scope


async def test_directory_rows_are_org_scoped_and_hold_only_a_digest(world: IdentityWorld) -> None:
    put = await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    assert put.permission_digest == permission_digest(GRANTS)
    assert await world.directory.get("org_other", ANN) is None
    with pytest.raises(NotFoundError):
        await world.directory.set_enabled("org_other", ANN, False)
    off = await world.directory.set_enabled(world.org, ANN, False)
    assert off.status is PrincipalStatus.DISABLED
    assert off.permission_digest == put.permission_digest  # status only
    with pytest.raises(InvalidArgumentError):
        await world.directory.put(world.org, "x" * 129, enabled=True, grants=())


async def test_concurrent_directory_writers_converge_on_one_row(world: IdentityWorld) -> None:
    await asyncio.gather(
        *(world.directory.put(world.org, ANN, enabled=True, grants=(f"g{i}",)) for i in range(4))
    )
    state = await world.directory.get(world.org, ANN)
    assert state is not None
    assert state.permission_digest in {permission_digest((f"g{i}",)) for i in range(4)}


async def test_run_identity_is_recorded_once_with_the_admission_context(
    world: IdentityWorld,
) -> None:
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(two_step_flow(), None)
    run = await world.start_as("two_steps")
    identity = await world.identity_of(run.flow_run_id)
    assert identity.initiating_principal_id == ANN
    assert identity.execution_principal_mode == "initiating_principal"
    expected = authorization_context_digest(ANN, await world.directory.get(world.org, ANN))
    assert identity.authorization_context_digest == expected
    # Written once: a second recording (another principal) changes nothing.
    from runtime_svc.identity import record_run_identity_txn
    from services import db

    _, plan = world.plans["two_steps"]
    async with db.transaction(world.engine) as conn:
        await record_run_identity_txn(conn, world.org, run.flow_run_id, "user-eve", plan)
    assert (await world.identity_of(run.flow_run_id)) == identity
    with pytest.raises(NotFoundError):
        async with db.transaction(world.engine, readonly=True) as conn:
            from runtime_svc.identity import read_run_identity_txn

            await read_run_identity_txn(conn, "org_other", run.flow_run_id)


async def test_cached_directory_state_is_reused_only_within_its_ttl(engine: AsyncEngine) -> None:
    now = [0.0]
    world = IdentityWorld(engine, new_scope(), reauth_ttl_s=30, reauth_clock=lambda: now[0])
    await world.directory.put(world.org, ANN, enabled=True, grants=GRANTS)
    await world.seed_with(two_step_flow(), None)
    run = await world.start_as("two_steps")
    await world.worker.run_batch(world.org)  # step one: caches Ann's enabled state
    await world.directory.set_enabled(world.org, ANN, False)

    now[0] = 10.0  # within the bound: the cached state is used, step two acts
    stale = await world.drive(run.flow_run_id)
    assert stale.state is RunState.SUCCEEDED

    second = await world.start_as("two_steps")
    now[0] = 31.0  # past the bound: the directory is read again and the step denied
    done = await world.drive(second.flow_run_id)
    assert done.state is RunState.TERMINAL_FAILED
    assert done.terminal_cause_code == "principal_disabled"


async def test_ops_cli_maintains_the_directory(
    world: IdentityWorld, kernel_db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def cli(*argv: str) -> int:
        return await asyncio.to_thread(ops.main, list(argv), db_url=kernel_db_url)

    who = ("--org", world.org, "--principal", ANN)
    assert await cli("principal", "show", *who) == 1
    assert "not_found" in capsys.readouterr().err
    assert (
        await cli("principal", "put", *who, "--grant", "Task.create", "--grant", "Case.read") == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown == {
        "principal_id": ANN,
        "status": "enabled",
        "permission_digest": permission_digest(["Case.read", "Task.create"]),
    }
    assert await cli("principal", "disable", *who) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "disabled"
    state = await world.directory.get(world.org, ANN)
    assert state is not None and state.status is PrincipalStatus.DISABLED
    assert await cli("principal", "enable", "--org", world.org, "--principal", "nobody") == 1
    assert await cli("principal", "put", "--org", world.org) == 2
