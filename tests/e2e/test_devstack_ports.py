"""Newcomer polish: a port already in use is reported on the terminal with its cause."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, free_port, service_env

pytestmark = pytest.mark.e2e


def _listening_socket() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, int(s.getsockname()[1])


def test_make_run_names_the_busy_port_its_variable_and_the_process_holding_it(
    tmp_path: Path,
) -> None:
    holder, busy = _listening_socket()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOW_")}
    env.update(
        {
            "FLOW_ENV": "test",
            "FLOW_DATA_DIR": str(tmp_path / "data"),
            "FLOW_CATALOG_PORT": str(free_port()),
            "FLOW_RUNTIME_PORT": str(busy),
            "FLOW_EFFECT_PORT": str(free_port()),
        }
    )
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flowctl.devstack"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.close()
    assert result.returncode == 2, result.stderr
    assert f"runtime: 127.0.0.1:{busy} (FLOW_RUNTIME_PORT) is not free" in result.stderr
    assert f"held by pid {os.getpid()}" in result.stderr  # this test process holds it
    assert "Is another `make run` running?" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_service_on_a_busy_port_says_so_and_names_the_variable(tmp_path: Path) -> None:
    holder, busy = _listening_socket()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "catalog_svc", "serve"],
            cwd=ROOT,
            env=service_env(tmp_path, "catalog", busy),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.close()
    assert result.returncode == 3, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{busy} (FLOW_CATALOG_PORT)" in result.stderr
    assert "Traceback" not in result.stderr
