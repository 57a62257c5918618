"""``flowctl flow register|activate|inventory`` against the running FlowDefinitionService."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from flowctl.__main__ import main
from tests.integration.definitions import flows
from tests.integration.definitions.harness import KEY_ID, Servers, new_org


@pytest.fixture
def cli_env(servers: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    key = tmp_path / "signing.pem"
    key.write_bytes(
        servers.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    monkeypatch.setenv("FLOW_AUTH_SIGNING_KEY", str(key))
    monkeypatch.setenv("FLOW_AUTH_SIGNING_KEY_ID", KEY_ID)
    return ["--target", f"127.0.0.1:{servers.runtime_port}"]


def test_register_activate_and_inventory(
    servers: Servers, cli_env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    org = new_org()
    pub = servers.catalog.publish(org, flows.view(org), flows.entries())
    scope = [
        "--org",
        org,
        "--app-installation",
        pub.scope[1],
        "--capability",
        pub.scope[2],
        "--binding-digest",
        pub.scope[3],
    ]
    source = tmp_path / "flow.json"
    source.write_text(json.dumps(flows.task_flow()), encoding="utf-8")
    assert main(["flow", "register", str(source), "--org", org, *cli_env]) == 0
    version = json.loads(capsys.readouterr().out)
    assert version["flow_api_name"] == "make_task"

    activate = ["flow", "activate", "--flow-version", version["flow_version_id"]]
    gen = ["--generation", pub.generation_id, "--catalog-digest", pub.catalog_digest]
    assert main([*activate, *gen, *scope, *cli_env]) == 0
    activation = json.loads(capsys.readouterr().out)
    assert activation["state"] == "ACTIVATION_STATE_ACTIVE"

    assert main(["flow", "inventory", *gen, *scope, *cli_env]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"make_task ({version['flow_version_id']}): compilable")
    assert "profile bounded_atomic" in out and "cohort small_bounded_atomic" in out
    assert main(["flow", "inventory", *gen, "--json", *scope, *cli_env]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["flow_api_name"] == "make_task" and row["compilable"]


def test_activate_reports_a_rejected_compile(
    servers: Servers, cli_env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    org = new_org()
    pub = servers.catalog.publish(org, flows.view(org), flows.entries())
    source = tmp_path / "flow.json"
    source.write_text(json.dumps(flows.unknown_capability_flow()), encoding="utf-8")
    assert main(["flow", "register", str(source), "--org", org, *cli_env]) == 0
    fv = json.loads(capsys.readouterr().out)["flow_version_id"]
    args = [
        "flow",
        "activate",
        "--flow-version",
        fv,
        "--generation",
        pub.generation_id,
        "--catalog-digest",
        pub.catalog_digest,
        "--org",
        org,
        "--app-installation",
        pub.scope[1],
        "--capability",
        pub.scope[2],
        "--binding-digest",
        pub.scope[3],
        *cli_env,
    ]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "compile rejected" in out and "(blocker: ActionCall sync)" in out
