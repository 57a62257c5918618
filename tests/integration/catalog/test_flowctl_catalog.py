"""``flowctl catalog build|show`` against a running catalog server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization

from flowctl.__main__ import main
from tests.integration.catalog.harness import KEY_ID, CatalogServer, new_id
from tests.support.procs import running_service

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "catalog" / "demo.yaml"


@pytest.fixture
def flowctl_env(
    catalog_server: CatalogServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CatalogServer:
    """flowctl signs with the key the test server trusts."""
    pem = catalog_server.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key = tmp_path / "signing.pem"
    key.write_bytes(pem)
    monkeypatch.setenv("FLOW_AUTH_SIGNING_KEY", str(key))
    monkeypatch.setenv("FLOW_AUTH_SIGNING_KEY_ID", KEY_ID)
    return catalog_server


def _demo(org: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    doc["org_id"] = org
    return doc


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _build(
    server: CatalogServer, capsys: pytest.CaptureFixture[str], path: Path, *extra: str
) -> dict[str, Any]:
    code, out, err = _run(capsys, "catalog", "build", str(path), "--target", server.target, *extra)
    assert code == 0, err
    summary: dict[str, Any] = json.loads(out)
    return summary


def _shuffled(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffled(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


def test_flowctl_catalog_build_seals_the_demo_catalog(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = _build(flowctl_env, capsys, DEMO, "--seal")

    assert summary["state"] == "GENERATION_STATE_SEALED"
    assert summary["catalog_digest"].startswith("catalog/v1:sha256:")
    assert summary["runtime_work_binding_digest"].startswith("runtime_work_binding/v1:")
    by_type = {e["action_type"]: e for e in summary["entries"]}
    assert sorted(by_type) == [
        "core.create_task",
        "core.format_name",
        "core.update_record",
        "crm.send_email",
    ]
    assert not any(e["contract_only"] for e in summary["entries"])  # create_task got bound
    assert all(e["binding_fingerprint"] for e in summary["entries"])


def test_flowctl_catalog_build_is_deterministic_across_key_order(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    org = new_id("org")
    plain, shuffled = tmp_path / "plain.json", tmp_path / "shuffled.json"
    plain.write_text(json.dumps(_demo(org)), encoding="utf-8")
    shuffled.write_text(json.dumps(_shuffled(_demo(org), random.Random(7))), encoding="utf-8")

    a = _build(flowctl_env, capsys, plain, "--seal")
    b = _build(flowctl_env, capsys, shuffled, "--seal")

    assert a["catalog_generation_id"] != b["catalog_generation_id"]
    assert a["runtime_work_binding_digest"] == b["runtime_work_binding_digest"]
    assert a["catalog_digest"] == b["catalog_digest"]
    assert a["entries"] == b["entries"]


def test_flowctl_catalog_show_prints_the_generation_and_its_entries(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    org = new_id("org")
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(_demo(org)), encoding="utf-8")
    built = _build(flowctl_env, capsys, path, "--seal")

    code, out, err = _run(
        capsys,
        "catalog",
        "show",
        "--target",
        flowctl_env.target,
        "--org",
        org,
        "--app-installation",
        built["app_installation_id"],
        "--capability",
        built["runtime_capability_id"],
        "--binding-digest",
        built["runtime_work_binding_digest"],
        "--generation",
        built["catalog_generation_id"],
    )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["generation"]["catalog_digest"] == built["catalog_digest"]
    assert [e["entry_digest"] for e in shown["entries"]] == [
        e["entry_digest"] for e in built["entries"]
    ]


def test_flowctl_catalog_build_without_seal_leaves_the_generation_open(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(_demo(new_id("org"))), encoding="utf-8")
    summary = _build(flowctl_env, capsys, path)
    assert summary["state"] == "GENERATION_STATE_OPEN"
    assert summary["catalog_digest"] == ""
    assert len(summary["entries"]) == 4


def test_flowctl_catalog_build_reports_a_conflict_naming_entry_and_field(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = _demo(new_id("org"))
    clash = json.loads(json.dumps(doc["entries"][0]))
    clash["handler_binding"]["handler_implementation_version"] = "1.0.1"
    doc["entries"].append(clash)
    path = tmp_path / "clash.json"
    path.write_text(json.dumps(doc), encoding="utf-8")

    code, _, err = _run(
        capsys, "catalog", "build", str(path), "--seal", "--target", flowctl_env.target
    )
    assert code == 1
    assert "FAILED_PRECONDITION" in err
    assert "core.format_name" in err and "handler_binding.handler_implementation_version" in err


def test_flowctl_catalog_build_rejects_an_invalid_document_before_calling(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = _demo(new_id("org"))
    doc["entries"][0]["descriptor"]["execution_class"] = "teleport"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    code, _, err = _run(capsys, "catalog", "build", str(path), "--target", flowctl_env.target)
    assert code == 1
    assert "entries[0].descriptor.execution_class" in err and "unknown_enum_value" in err


def test_flowctl_catalog_build_needs_the_installation_and_capability(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = _demo(new_id("org"))
    del doc["app_installation_id"], doc["runtime_capability_id"]
    path = tmp_path / "scopeless.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    code, _, err = _run(capsys, "catalog", "build", str(path), "--target", flowctl_env.target)
    assert code == 1 and "--app-installation" in err
    code, out, err = _run(
        capsys,
        "catalog",
        "build",
        str(path),
        "--target",
        flowctl_env.target,
        "--app-installation",
        "inst-cli",
        "--capability",
        "cap-cli",
    )
    assert code == 0, err
    assert json.loads(out)["app_installation_id"] == "inst-cli"


def test_flowctl_catalog_show_needs_the_complete_scope(
    flowctl_env: CatalogServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(
        capsys, "catalog", "show", "--target", flowctl_env.target, "--generation", "gen-1"
    )
    assert code == 1 and "--binding-digest" in err


@pytest.mark.e2e
def test_flowctl_catalog_build_against_the_catalog_service_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m catalog_svc`` (production wiring, dev keys) + ``flowctl catalog build``."""
    with running_service(tmp_path, "catalog") as svc:
        monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("FLOW_AUTH_SIGNING_KEY", raising=False)
        monkeypatch.delenv("FLOW_AUTH_SIGNING_KEY_ID", raising=False)
        code, out, err = _run(
            capsys, "catalog", "build", str(DEMO), "--seal", "--target", f"127.0.0.1:{svc.port}"
        )
        assert code == 0, f"{err}\n{svc.log_text()[-2000:]}"
        summary = json.loads(out)
        assert summary["state"] == "GENERATION_STATE_SEALED"
        assert len(summary["entries"]) == 4
