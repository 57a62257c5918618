"""``FLOW_RUNTIME_WORKER_PROCESSES`` parsing, the worker processes' environment and the
pool's restart backoff (pure; the processes themselves: ``tests/crash/
test_worker_processes.py`` and ``tests/integration/services/test_process_pool.py``)."""

from __future__ import annotations

import pytest

from runtime_svc import __main__ as runtime_main
from runtime_svc.processes import CHILD_OVERRIDES, child_argv, child_env
from services.config import (
    MAX_WORKER_PROCESSES,
    ConfigError,
    ServiceName,
    load_config,
    usable_cores,
    worker_processes,
)
from services.process_pool import RestartPolicy


@pytest.mark.parametrize(
    ("raw", "cores", "expected"),
    [("0", 8, 0), ("3", 8, 3), (" 2 ", 1, 2), ("auto", 2, 2), ("AUTO", 12, 12), ("auto", 500, 64)],
)
def test_worker_processes_values(raw: str, cores: int, expected: int) -> None:
    assert worker_processes(raw, cores) == expected


@pytest.mark.parametrize("raw", ["-1", "two", "1.5", "", str(MAX_WORKER_PROCESSES + 1)])
def test_worker_processes_refuses_bad_values_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"FLOW_RUNTIME_WORKER_PROCESSES must be auto or an"):
        worker_processes(raw, 4)


def test_load_config_defaults_to_in_process_workers_and_resolves_auto() -> None:
    assert load_config(ServiceName.RUNTIME, {}).runtime_worker_processes == 0
    cfg = load_config(ServiceName.RUNTIME, {"FLOW_RUNTIME_WORKER_PROCESSES": "auto"})
    assert cfg.runtime_worker_processes == min(usable_cores(), MAX_WORKER_PROCESSES) >= 1
    with pytest.raises(ConfigError, match="FLOW_RUNTIME_WORKER_PROCESSES"):
        load_config(ServiceName.RUNTIME, {"FLOW_RUNTIME_WORKER_PROCESSES": "many"})


def test_bad_worker_processes_exits_2_with_the_variable_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLOW_RUNTIME_WORKER_PROCESSES", "-3")
    monkeypatch.setattr("sys.argv", ["runtime_svc", "serve"])
    assert runtime_main.main() == 2
    err = capsys.readouterr().err
    assert "configuration error: FLOW_RUNTIME_WORKER_PROCESSES must be auto or an integer" in err


def test_child_env_keeps_the_deployment_and_moves_the_singleton_duties_out() -> None:
    parent = {
        "FLOW_RUNTIME_DB_URL": "mysql+aiomysql://u@db/rt",
        "FLOW_RUNTIME_WORKERS": "4",
        "FLOW_RUNTIME_WORKER_PROCESSES": "auto",
        "FLOW_RUNTIME_SWEEPS": "true",
        "FLOW_METRICS_PORT": "9464",
        "FLOW_OUTBOX_DISPATCHERS": "1",
    }
    env = child_env(parent)
    assert env["FLOW_RUNTIME_DB_URL"] == parent["FLOW_RUNTIME_DB_URL"]
    assert env["FLOW_RUNTIME_WORKERS"] == "4"  # tasks per worker process
    assert env["FLOW_OUTBOX_DISPATCHERS"] == "1"  # woken by its own process's commits
    assert env["FLOW_RUNTIME_WORKER_PROCESSES"] == "0"  # no grand-children
    assert env["FLOW_RUNTIME_SWEEPS"] == "false"
    assert env["FLOW_RUNTIME_LEGACY_SCHEDULER"] == "false"
    assert env["FLOW_DB_AUTO_MIGRATE"] == "false"
    assert env["FLOW_METRICS_PORT"] == "" and env["FLOW_RUNTIME_PORT"] == "0"
    assert parent["FLOW_RUNTIME_SWEEPS"] == "true"  # the parent's mapping is not changed
    cfg = load_config(ServiceName.RUNTIME, env)
    assert (cfg.runtime_worker_processes, cfg.runtime_sweeps, cfg.port) == (0, False, 0)
    assert cfg.telemetry.metrics_port is None
    assert set(CHILD_OVERRIDES) <= set(env)
    assert child_argv()[-3:] == ["runtime_svc", "worker", "--supervised"]


def test_restart_backoff_grows_caps_and_resets_after_a_stable_run() -> None:
    p = RestartPolicy(base_s=0.5, max_s=30.0, stable_s=30.0, jitter=0.2)
    assert [p.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert p.delay(20) == 30.0
    assert 0.4 <= p.delay(1, 0.0) <= p.delay(1, 0.999) <= 0.6
    assert p.failures_after(3, ran_s=1.0) == 4  # another short life
    assert p.failures_after(7, ran_s=31.0) == 1  # it was healthy: start over
