"""Trusted keys carry constraints (issue 10, item 13): a credential whose claims exceed
what its signing key may sign is UNAUTHENTICATED; the deprecated unconstrained file form
is read outside production only and migrated by ``ensure_dev_keys``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.auth import (
    CANCEL_ROLE,
    DELETE_ROLE,
    HANDOFF_SUBMIT_ROLE,
    OPERATOR_ROLES,
    SIGNALS_SUBMIT_ROLE,
    CredentialVerifier,
    KeyConstraints,
    TrustedKey,
    WorkloadClaims,
    ensure_dev_keys,
    generate_keypair,
    load_signing_key,
    load_trusted_keys,
    mint_credential,
    service_key_file,
    service_key_id,
)
from services.config import ConfigError, ServiceName, load_config
from services.digest import versioned_digest
from services.errors import UnauthenticatedError

NOW = 1_700_000_000
PRIVATE, PUBLIC = generate_keypair()
DIGEST = versioned_digest("runtime_work_binding", {"b": 1})


def _pem(key: Any = PUBLIC) -> str:
    return str(key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode())


def _claims(
    org: str = "org-a",
    audiences: tuple[ServiceName, ...] = (ServiceName.RUNTIME,),
    roles: tuple[str, ...] = (),
) -> WorkloadClaims:
    return WorkloadClaims(subject="ops", audiences=audiences, org_id=org, roles=roles)


def _verify(
    constraints: KeyConstraints,
    claims: WorkloadClaims,
    audience: ServiceName = ServiceName.RUNTIME,
    key: Ed25519PrivateKey = PRIVATE,
) -> Any:
    verifier = CredentialVerifier({"k": TrustedKey(PUBLIC, constraints)}, audience, now=lambda: NOW)
    return verifier.verify(mint_credential(key, "k", claims, ttl_s=60, now=NOW))


OPS_ACME = KeyConstraints(
    orgs=frozenset({"org-a"}),
    audiences=frozenset({"runtime"}),
    roles=frozenset({CANCEL_ROLE}),
)


def test_claims_within_the_constraints_are_accepted() -> None:
    identity = _verify(OPS_ACME, _claims(roles=(CANCEL_ROLE,)))
    assert identity.org_id == "org-a"
    assert identity.roles == {CANCEL_ROLE}


@pytest.mark.parametrize(
    ("claims", "claim"),
    [
        (_claims(org="org-b"), "org_id"),
        (_claims(audiences=(ServiceName.RUNTIME, ServiceName.CATALOG)), "aud"),
        (_claims(roles=(DELETE_ROLE,)), "roles"),
        (_claims(roles=(CANCEL_ROLE, "flow.admin")), "roles"),
    ],
)
def test_a_claim_beyond_the_key_constraints_is_unauthenticated(
    claims: WorkloadClaims, claim: str
) -> None:
    with pytest.raises(UnauthenticatedError) as refused:
        _verify(OPS_ACME, claims)
    assert refused.value.reason == "credential_exceeds_key_constraints"
    assert refused.value.attributes == {"claim": claim}
    # Nothing of the credential is echoed.
    assert "org-b" not in refused.value.safe_message


def test_a_service_key_acts_for_every_org_but_only_its_audiences_and_no_roles() -> None:
    service = KeyConstraints(frozenset({"*"}), frozenset({"catalog"}), frozenset())
    audience = (ServiceName.CATALOG,)
    for org in ("org-a", "org-zzz"):
        assert _verify(service, _claims(org, audience), ServiceName.CATALOG).org_id == org
    with pytest.raises(UnauthenticatedError):
        _verify(service, _claims("org-a", audience, (CANCEL_ROLE,)), ServiceName.CATALOG)
    with pytest.raises(UnauthenticatedError):
        _verify(service, _claims("org-a", (ServiceName.RUNTIME,)), ServiceName.RUNTIME)


def _write(path: Path, document: object) -> Path:
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def test_version_2_file_is_read_with_its_constraints(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "trusted.json",
        {
            "version": 2,
            "keys": {
                "k": {
                    "public_key": _pem(),
                    "orgs": ["org-a"],
                    "audiences": ["runtime"],
                    "roles": [CANCEL_ROLE],
                }
            },
        },
    )
    keys = load_trusted_keys(path, allow_unconstrained=False)
    assert keys["k"].constraints == OPS_ACME


@pytest.mark.parametrize(
    "entry",
    [
        {"orgs": ["org-a"], "audiences": ["runtime"], "roles": []},  # no key
        {"public_key": "x", "orgs": ["org-a"], "audiences": ["runtime"], "roles": []},
        {"public_key": "PEM", "orgs": [], "audiences": ["runtime"], "roles": []},
        {"public_key": "PEM", "orgs": ["org-a"], "audiences": [], "roles": []},
        {"public_key": "PEM", "orgs": ["org-a"], "audiences": ["billing"], "roles": []},
        {"public_key": "PEM", "orgs": ["org-a"], "audiences": ["runtime"]},  # no roles
        {"public_key": "PEM", "orgs": "org-a", "audiences": ["runtime"], "roles": []},
        {"public_key": "PEM", "orgs": ["a"], "audiences": ["runtime"], "roles": [], "x": 1},
    ],
)
def test_malformed_version_2_entries_are_configuration_errors(
    tmp_path: Path, entry: dict[str, Any]
) -> None:
    if entry.get("public_key") == "PEM":
        entry["public_key"] = _pem()
    path = _write(tmp_path / "t.json", {"version": 2, "keys": {"k": entry}})
    with pytest.raises(ConfigError):
        load_trusted_keys(path)


def test_unknown_version_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", {"version": 3, "keys": {}})
    with pytest.raises(ConfigError, match="version"):
        load_trusted_keys(path)


def test_deprecated_form_is_unconstrained_outside_production_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trusted = _write(tmp_path / "trusted.json", {"k": _pem()})
    with caplog.at_level(logging.WARNING, logger="services.auth.trust"):
        keys = load_trusted_keys(trusted)
    assert "deprecated" in caplog.text
    assert "*" in keys["k"].constraints.orgs
    env = {"FLOW_DATA_DIR": str(tmp_path), "FLOW_AUTH_TRUSTED_KEYS": str(trusted)}
    CredentialVerifier.from_config(load_config(ServiceName.RUNTIME, env))
    with pytest.raises(ConfigError, match="production"):
        CredentialVerifier.from_config(
            load_config(ServiceName.RUNTIME, env | {"FLOW_ENV": "production"})
        )


def test_dev_keys_constrain_the_operator_and_each_service_key(tmp_path: Path) -> None:
    files = ensure_dev_keys(tmp_path, env="development")
    keys = load_trusted_keys(files.trusted_keys, allow_unconstrained=False)
    operator = keys["dev"].constraints
    assert operator.roles == frozenset(OPERATOR_ROLES)
    assert operator.audiences == {"catalog", "runtime", "effect-owner"}
    runtime = keys["runtime-service"].constraints
    assert runtime.orgs == {"*"}
    assert runtime.audiences == {"catalog", "effect-owner"}
    # Each service key may sign only the one role its calls need.
    assert runtime.roles == {HANDOFF_SUBMIT_ROLE}
    assert keys["effect-owner-service"].constraints.audiences == {"runtime"}
    assert keys["effect-owner-service"].constraints.roles == {SIGNALS_SUBMIT_ROLE}

    # The runtime's own key cannot act as an operator.
    runtime_key = load_signing_key(files.runtime_service_key)
    verifier = CredentialVerifier(keys, ServiceName.RUNTIME, now=lambda: NOW)
    claims = _claims(roles=(CANCEL_ROLE,))
    with pytest.raises(UnauthenticatedError):
        verifier.verify(mint_credential(runtime_key, "runtime-service", claims, ttl_s=60, now=NOW))


def test_dev_keys_widen_an_existing_dev_entry_to_the_roles_this_version_needs(
    tmp_path: Path,
) -> None:
    """A dev stack whose trusted-keys file predates a role keeps working after upgrade."""
    files = ensure_dev_keys(tmp_path, env="development")
    doc = json.loads(files.trusted_keys.read_text(encoding="utf-8"))
    doc["keys"]["runtime-service"]["roles"] = []
    doc["keys"]["dev"]["roles"] = [CANCEL_ROLE]
    files.trusted_keys.write_text(json.dumps(doc), encoding="utf-8")

    ensure_dev_keys(tmp_path, env="development")
    keys = load_trusted_keys(files.trusted_keys, allow_unconstrained=False)
    assert keys["runtime-service"].constraints.roles == {HANDOFF_SUBMIT_ROLE}
    assert keys["dev"].constraints.roles == frozenset(OPERATOR_ROLES)


def test_config_defaults_name_the_dev_service_keys(tmp_path: Path) -> None:
    files = ensure_dev_keys(tmp_path, env="development")
    cfg = load_config(ServiceName.RUNTIME, {"FLOW_DATA_DIR": str(tmp_path)})
    assert cfg.auth_service_key == files.runtime_service_key
    assert cfg.auth_service_key.name == service_key_file(ServiceName.RUNTIME)
    assert cfg.auth_service_key_id == service_key_id(ServiceName.RUNTIME) == "runtime-service"
    owner = load_config(ServiceName.EFFECT_OWNER, {"FLOW_DATA_DIR": str(tmp_path)})
    assert owner.auth_service_key == files.effect_owner_service_key


def test_dev_keys_migrate_the_deprecated_file_of_an_earlier_make_run(tmp_path: Path) -> None:
    first = ensure_dev_keys(tmp_path, env="development")
    dev_pem = _pem(load_signing_key(first.signing_key).public_key())
    other_private, other_public = generate_keypair()
    # What an earlier `make run` wrote, plus a key an operator added by hand.
    _write(first.trusted_keys, {"dev": dev_pem, "ops": _pem(other_public)})

    files = ensure_dev_keys(tmp_path, env="development")
    keys = load_trusted_keys(files.trusted_keys, allow_unconstrained=False)
    assert set(keys) == {"dev", "ops", "runtime-service", "effect-owner-service"}
    assert keys["dev"].constraints.roles == frozenset(OPERATOR_ROLES)
    # The hand-added key keeps meaning "anything", now stated explicitly.
    assert keys["ops"].constraints.orgs == {"*"}
    assert keys["ops"].constraints.roles == {"*"}
    identity = CredentialVerifier(keys, ServiceName.CATALOG, now=lambda: NOW).verify(
        mint_credential(
            other_private,
            "ops",
            _claims(audiences=(ServiceName.CATALOG,), roles=("custom",)),
            ttl_s=60,
            now=NOW,
        )
    )
    assert identity.roles == {"custom"}

    migrated = files.trusted_keys.read_bytes()
    ensure_dev_keys(tmp_path, env="test")
    assert files.trusted_keys.read_bytes() == migrated  # idempotent


async def test_a_production_runtime_without_its_service_key_does_not_start(
    tmp_path: Path,
) -> None:
    from runtime_svc.app import RuntimeApp

    cfg = load_config(
        ServiceName.RUNTIME,
        {
            "FLOW_ENV": "production",
            "FLOW_DATA_DIR": str(tmp_path),
            "FLOW_AUTH_SERVICE_KEY": str(tmp_path / "missing.pem"),
        },
    )
    with pytest.raises(ConfigError, match="signing key"):
        await RuntimeApp().build_services(cfg, None)  # type: ignore[arg-type]
