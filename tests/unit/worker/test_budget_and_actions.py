"""The runtime budget meter (§9.1/§9.2 bounds enforced while a step runs) and the
built-in pure actions an ``ActionCall`` runs inline."""

from __future__ import annotations

import pytest

from runtime_svc.compiler.plan import BoundSummary
from runtime_svc.worker.actions import PURE_ACTIONS, PureActionError, run_pure_action
from runtime_svc.worker.budget import BudgetExceeded, BudgetMeter


def test_each_counter_stops_at_its_bound_and_names_it() -> None:
    meter = BudgetMeter(BoundSummary(2, 3, 1, 2, ()))
    meter.step()
    meter.step()
    with pytest.raises(BudgetExceeded) as err:
        meter.step()
    assert (err.value.bound, err.value.limit, err.value.attempted) == ("max_steps", 2, 3)
    meter.read(3)
    with pytest.raises(BudgetExceeded) as err:
        meter.read(0)  # a miss still costs a read
    assert err.value.bound == "max_reads"
    meter.write()
    with pytest.raises(BudgetExceeded) as err:
        meter.write()
    assert err.value.bound == "max_writes"
    meter.fan_out(2)
    with pytest.raises(BudgetExceeded) as err:
        meter.fan_out()
    assert err.value.bound == "max_fanout"
    with pytest.raises(BudgetExceeded):
        meter.check_collection(3)
    # A failed charge does not move the counter.
    assert (meter.steps, meter.reads, meter.writes, meter.fanout) == (2, 3, 1, 2)


def test_unknown_bounds_are_not_enforced() -> None:
    meter = BudgetMeter(BoundSummary(None, None, None, None, (), ("max_reads",)))
    for _ in range(1000):
        meter.step()
        meter.read(5)
        meter.write()
        meter.fan_out()
    meter.check_collection(10_000)
    assert meter.reads == 5000


def test_pure_actions() -> None:
    assert set(PURE_ACTIONS) == {"format_text", "core.format_name", "score_opportunity"}
    assert run_pure_action("format_text", {"text": "Acme / High", "style": "upper"}) == (
        "ACME / HIGH"
    )
    assert run_pure_action("format_text", {"text": " x "}) == " x "
    assert run_pure_action("core.format_name", {"first_name": " Ada ", "last_name": "L"}) == (
        "Ada L"
    )
    assert run_pure_action("score_opportunity", {"amount": 42_500}) == 42
    assert run_pure_action("score_opportunity", {"amount": 10**9}) == 100
    assert run_pure_action("score_opportunity", {"amount": None}) == 0
    with pytest.raises(PureActionError):
        run_pure_action("format_text", {"text": "x", "style": "shout"})
    with pytest.raises(PureActionError):
        run_pure_action("score_opportunity", {"amount": "lots"})
    with pytest.raises(KeyError):
        run_pure_action("charge_card", {})
