"""§22.6 for effects on SQLite and MariaDB: identical effect handoffs (same Flow, same
inputs, same owner kind) in two installations of one org and in another org never share
a key, an outbox message, a link, an owner command or a receipt; a receipt submitted
under another work scope wakes nothing."""

from __future__ import annotations

from runtime_svc.effects import submit_identities
from runtime_svc.kernel import RunState
from runtime_svc.waits.evidence import SignalSubmission
from services.effect_contract import CompletionEvidence, CompletionOutcomeCode
from tests.integration.flow_effects.world import EffectWorld, email_flow
from tests.integration.waits.support import new_scope


def _sibling(world: EffectWorld, org: str, installation: str) -> EffectWorld:
    """Another work scope on the same databases, owner and servers."""
    runtime = world.runtime.other(new_scope(org, installation))
    return EffectWorld(
        runtime,
        world.owner_engine,
        world.owner,
        world.sink,
        world.receiver,
        world.providers,
        world.private_key,
        world.tmp,
        world.wake_port,
    )


async def test_identical_handoffs_in_other_scopes_stay_apart(world: EffectWorld) -> None:
    other_install = _sibling(world, world.org, "inst-crm-2")
    other_org = _sibling(world, world.org + "x", world.runtime.scope.app_installation_id)
    worlds = [world, other_install, other_org]
    runs = []
    for version, w in enumerate(worlds, start=1):
        # One Flow version row per (org, API name, version): the sibling installation
        # of the same org stores its own version of the identical Flow.
        await w.seed({**email_flow(), "version": version})
        runs.append(await w.start("effect_email", to="ada@example.com", name="Ada"))
    for w in worlds:
        await w.work()
    keys = {
        submit_identities(
            w.runtime.scope, flow_run_id=r.flow_run_id, submit_step_key="send#submit",
            invocation_ordinal=0,
        ).handoff_key
        for w, r in zip(worlds, runs, strict=True)
    }  # fmt: skip
    assert len(keys) == 3

    # A receipt for the first run's key, submitted under the sibling installation's
    # scope (identical org, kind, key and token): it is that scope's signal and wakes
    # nothing — neither run's dependency can match it.
    key = next(iter(k for k in keys if k.split(":")[1] in _scope_part(world)))
    evidence = CompletionEvidence(
        command_id="cmd_x",
        outcome_version=1,
        outcome=CompletionOutcomeCode.SUCCEEDED,
        effect_owner_kind="email-gateway",
        effect_handoff_key=key,
    )
    await other_install.runtime.rt.signals.submit(
        other_install.runtime.work,
        SignalSubmission(
            producer_kind="effect.completion",
            producer_key=key,
            wake_token=evidence.wake_token,
            wake_version=1,
            evidence_digest=evidence.digest(),
            evidence_json=evidence.to_json(),
        ),
    )
    for w, r in zip(worlds, runs, strict=True):
        assert (await w.run(r.flow_run_id)).state is RunState.WAITING

    for w, r in zip(worlds, runs, strict=True):
        done = await w.settle(r.flow_run_id)
        assert done.state is RunState.SUCCEEDED, done
        assert await w.outbox_rows(r.flow_run_id) == 1
        assert await w.links(r.flow_run_id) == 1
    # One command per scope (the first org holds two installations' commands).
    assert await world.commands_count() == 2
    assert await other_org.commands_count() == 1
    assert world.sink.data_commands == 3
    outputs = {(await w.output(r.flow_run_id))["msgId"] for w, r in zip(worlds, runs, strict=True)}
    assert len(outputs) == 3


def _scope_part(world: EffectWorld) -> str:
    from services.effect_contract import handoff_scope_part

    return handoff_scope_part(world.runtime.scope)
