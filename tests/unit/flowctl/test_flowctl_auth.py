"""flowctl auth mint: credentials the services accept, clear errors without a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowctl.__main__ import main
from services.auth import CredentialVerifier, ensure_dev_keys, load_trusted_keys
from services.config import ServiceName
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
