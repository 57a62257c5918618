"""``flowctl flow compile|plan``: local, pure, the same compiler and views as activation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowctl.__main__ import main
from runtime_svc.compiler import explain, to_mermaid
from tests.unit.definitions import corpus

CLOSE_WON = str(corpus.FLOWS / "atomic_close_won" / "flow.json")
INPUTS = str(corpus.INPUTS)


def test_compile_explain_matches_the_golden_explanation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["flow", "compile", CLOSE_WON, "--inputs", INPUTS, "--explain"]) == 0
    golden = (corpus.FLOWS / "atomic_close_won" / "explain.txt").read_text(encoding="utf-8")
    assert capsys.readouterr().out == golden == explain(corpus.plan("atomic_close_won"))


def test_compile_json_is_the_canonical_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flow", "compile", CLOSE_WON, "--inputs", INPUTS, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == corpus.plan("atomic_close_won").to_dict()


def test_plan_mermaid_draws_the_step_graph(capsys: pytest.CaptureFixture[str]) -> None:
    flow = str(corpus.FLOWS / "durable_send_email" / "flow.json")
    assert main(["flow", "plan", flow, "--inputs", INPUTS, "--mermaid"]) == 0
    out = capsys.readouterr().out
    assert out == to_mermaid(corpus.plan("durable_send_email"))
    assert out.startswith("flowchart TD") and "EffectSubmit" in out


def test_a_rejected_flow_prints_every_blocker_and_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flow = str(corpus.FLOWS / "reject_atomic_unknown_capability" / "flow.json")
    assert main(["flow", "compile", flow, "--inputs", INPUTS]) == 1
    out = capsys.readouterr().out
    assert "[atomic_unsafe.unknown_capability]" in out
    assert "(blocker: ActionCall sync)" in out


def test_inputs_may_be_one_bundle_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "inputs.json"
    bundle.write_text(json.dumps(corpus.inputs_doc()), encoding="utf-8")
    assert main(["flow", "compile", CLOSE_WON, "--inputs", str(bundle)]) == 0
    assert "Profile: bounded_atomic" in capsys.readouterr().out


def test_unusable_inputs_are_a_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["flow", "compile", CLOSE_WON, "--inputs", str(tmp_path)]) == 1
    assert "missing binding.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["durable_wait_record_condition", "durable_wait_event_terminal"])
def test_compile_explain_shows_each_dependency_its_producer_and_bounds(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime accepts approval.decision signals; the explanation is the golden one.
    monkeypatch.setenv("FLOW_RUNTIME_SIGNAL_KINDS", "approval.decision")
    flow = str(corpus.FLOWS / name / "flow.json")
    assert main(["flow", "compile", flow, "--inputs", INPUTS, "--explain"]) == 0
    out = capsys.readouterr().out
    assert out == (corpus.FLOWS / name / "explain.txt").read_text(encoding="utf-8")
    assert "dependency: producer=" in out and "bounds: max wait age" in out
    # Unconfigured, the same Flow's producer would block activation, and explain says so.
    if name == "durable_wait_event_terminal":
        monkeypatch.delenv("FLOW_RUNTIME_SIGNAL_KINDS")
        assert main(["flow", "compile", flow, "--inputs", INPUTS, "--explain"]) == 0
        assert "approval.decision NOT REGISTERED (activation fails)" in capsys.readouterr().out
