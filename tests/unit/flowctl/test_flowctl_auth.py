"""flowctl auth mint: credentials the services accept, clear errors without a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowctl.__main__ import main
from services.auth import CredentialVerifier, ensure_dev_keys, load_trusted_keys
from services.config import ServiceName
from services.digest import versioned_digest
from services.errors import UnauthenticatedError


def test_minted_credential_verifies_for_the_requested_audience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = ensure_dev_keys(tmp_path, env="test")
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
    assert main(["auth", "mint", "--org", "org-7", "--audience", "catalog"]) == 0
    token = capsys.readouterr().out.strip()
    trusted = load_trusted_keys(keys.trusted_keys)
    identity = CredentialVerifier(trusted, ServiceName.CATALOG).verify(token)
    assert identity.org_id == "org-7"
    with pytest.raises(UnauthenticatedError) as refused:
        CredentialVerifier(trusted, ServiceName.RUNTIME).verify(token)
    assert refused.value.reason == "credential_wrong_audience"


def test_missing_signing_key_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path / "nothing"))
    assert main(["auth", "mint", "--org", "org-7"]) == 2
    assert "signing key" in capsys.readouterr().err


def _demo_summary(data_dir: Path, digest: str) -> None:
    (data_dir / "demo.json").write_text(
        json.dumps(
            {
                "org_id": "org-demo",
                "app_installation_id": "inst-demo",
                "runtime_capability_id": "cap-demo",
                "binding_digest": digest,
            }
        ),
        encoding="utf-8",
    )


def test_default_token_is_for_the_demos_complete_work_scope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = ensure_dev_keys(tmp_path, env="test")
    digest = versioned_digest("runtime_work_binding", {"demo": 1})
    _demo_summary(tmp_path, digest)
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
    assert main(["auth", "mint"]) == 0
    token = capsys.readouterr().out.strip()
    verifier = CredentialVerifier(load_trusted_keys(keys.trusted_keys), ServiceName.RUNTIME)
    identity = verifier.verify(token)
    assert identity.work_scope is not None
    assert identity.work_scope.runtime_work_binding_digest == digest
    assert identity.work_scope.app_installation_id == "inst-demo"
    assert identity.roles == frozenset()


def test_roles_are_minted_and_checked_against_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = ensure_dev_keys(tmp_path, env="test")
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
    args = ["auth", "mint", "--org", "org-7", "--role", "flow.runs.cancel"]
    assert main([*args, "--role", "flow.runs.delete"]) == 0
    token = capsys.readouterr().out.strip()
    trusted = load_trusted_keys(keys.trusted_keys)
    identity = CredentialVerifier(trusted, ServiceName.RUNTIME).verify(token)
    assert identity.roles == {"flow.runs.cancel", "flow.runs.delete"}
    assert identity.work_scope is None  # --org alone: an org-only credential

    with pytest.raises(SystemExit) as bad:
        main(["auth", "mint", "--org", "org-7", "--role", "flow.admin"])
    assert bad.value.code == 2
    assert "flow.admin" in capsys.readouterr().err


def test_without_org_or_demo_summary_the_error_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ensure_dev_keys(tmp_path, env="test")
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path))
    assert main(["auth", "mint"]) == 1
    err = capsys.readouterr().err
    assert "make run" in err and "--org" in err
    assert main(["auth", "mint", "--capability", "cap-1"]) == 1
    assert "need --org" in capsys.readouterr().err
