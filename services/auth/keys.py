"""Key material: Ed25519 key pairs, the trusted-keys file, development keys.

Nothing here logs or echoes key material; errors name the file, never its content.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.config import ConfigError, ServiceName

from .trust import (
    ANY,
    HANDOFF_SUBMIT_ROLE,
    OPERATOR_ROLES,
    SIGNALS_SUBMIT_ROLE,
    UNCONSTRAINED,
    KeyConstraints,
    TrustedKey,
    parse_trusted_keys,
    trusted_keys_document,
)

__all__ = [
    "DEV_OPERATOR_CONSTRAINTS",
    "DEV_SERVICE_AUDIENCES",
    "DEV_SIGNING_KEY_FILE",
    "TRUSTED_KEYS_FILE",
    "DevKeyFiles",
    "ensure_dev_keys",
    "generate_keypair",
    "load_signing_key",
    "load_trusted_keys",
    "service_key_file",
    "service_key_id",
]

DEV_SIGNING_KEY_FILE = "dev_signing_key.pem"
TRUSTED_KEYS_FILE = "trusted_keys.json"


def generate_keypair() -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """A fresh Ed25519 signing key and its public key."""
    private = Ed25519PrivateKey.generate()
    return private, private.public_key()


def _private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _public_pem(key: Ed25519PublicKey) -> str:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def load_trusted_keys(path: Path, *, allow_unconstrained: bool = True) -> dict[str, TrustedKey]:
    """Read the trusted-keys file (format: :mod:`services.auth.trust`).

    Args:
        path: the file.
        allow_unconstrained: accept the deprecated ``{key_id: PEM}`` form (false in
            production).

    Raises:
        ConfigError: the file is missing, malformed, empty, holds a non-Ed25519 key, or
            uses the deprecated form where it is not allowed.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read trusted keys {path}: {type(exc).__name__}") from exc
    return parse_trusted_keys(raw, str(path), allow_unconstrained=allow_unconstrained)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read an unencrypted PKCS#8 PEM Ed25519 private key.

    Raises:
        ConfigError: the file is missing or not an Ed25519 private key.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        # The exception text never contains key material.
        raise ConfigError(f"cannot read signing key {path}: {type(exc).__name__}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an Ed25519 key")
    return key


class DevKeyFiles(NamedTuple):
    """The files :func:`ensure_dev_keys` maintains."""

    signing_key: Path
    trusted_keys: Path
    runtime_service_key: Path
    effect_owner_service_key: Path


#: What each service's own key may sign in the development stack: every org (a service
#: acts for the org of the request it serves), only the services it calls, no roles.
DEV_SERVICE_AUDIENCES: Mapping[ServiceName, tuple[ServiceName, ...]] = {
    ServiceName.RUNTIME: (ServiceName.CATALOG, ServiceName.EFFECT_OWNER),
    ServiceName.EFFECT_OWNER: (ServiceName.RUNTIME,),
}
#: The roles each service's own key may sign in the development stack: the runtime hands
#: effects to the owner, the owner submits completion receipts as wake signals.
DEV_SERVICE_ROLES: Mapping[ServiceName, tuple[str, ...]] = {
    ServiceName.RUNTIME: (HANDOFF_SUBMIT_ROLE,),
    ServiceName.EFFECT_OWNER: (SIGNALS_SUBMIT_ROLE,),
}
#: What the development operator key (``flowctl``, ``make run``'s token) may sign.
DEV_OPERATOR_CONSTRAINTS = KeyConstraints(
    orgs=frozenset({ANY}),
    audiences=frozenset(s.value for s in ServiceName),
    roles=frozenset(OPERATOR_ROLES),
)


def service_key_file(service: ServiceName) -> str:
    """File name of ``service``'s own signing key under ``<data dir>/auth/``."""
    return f"{service.value}_service_key.pem"


def service_key_id(service: ServiceName) -> str:
    """Default key id of ``service``'s own signing key."""
    return f"{service.value}-service"


def _dev_service_constraints(service: ServiceName) -> KeyConstraints:
    return KeyConstraints(
        orgs=frozenset({ANY}),
        audiences=frozenset(a.value for a in DEV_SERVICE_AUDIENCES[service]),
        roles=frozenset(DEV_SERVICE_ROLES[service]),
    )


def _widened(have: KeyConstraints, want: KeyConstraints) -> KeyConstraints:
    """``have`` plus whatever of ``want`` it lacks (a wildcard stays a wildcard)."""

    def union(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
        return frozenset({ANY}) if ANY in a else a | b

    return KeyConstraints(
        orgs=union(have.orgs, want.orgs),
        audiences=union(have.audiences, want.audiences),
        roles=union(have.roles, want.roles),
    )


def _ensure_key(path: Path) -> str:
    if not path.exists():
        _create_exclusive(path, _private_pem(generate_keypair()[0]))
    return _public_pem(load_signing_key(path).public_key())


def _current_entries(path: Path, dev_key_id: str) -> dict[str, tuple[str, KeyConstraints]]:
    """The entries of an existing trusted-keys file, the deprecated form migrated: its
    ``dev_key_id`` entry gets the operator constraints, any other entry keeps meaning
    "anything" — now written out explicitly."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a JSON object")
    if "keys" in raw or "version" in raw:
        keys = raw.get("keys")
        if not isinstance(keys, dict):
            raise ConfigError(f"{path}: 'keys' must be an object")
        parsed = parse_trusted_keys(raw, str(path), allow_unconstrained=False)
        return {kid: (str(keys[kid]["public_key"]), key.constraints) for kid, key in parsed.items()}
    return {
        str(kid): (str(pem), DEV_OPERATOR_CONSTRAINTS if kid == dev_key_id else UNCONSTRAINED)
        for kid, pem in raw.items()
    }


def ensure_dev_keys(data_dir: Path, *, env: str, key_id: str = "dev") -> DevKeyFiles:
    """Create development keys and the trusted-keys file under ``<data_dir>/auth/``.

    * ``dev_signing_key.pem`` — the operator key ``flowctl`` and ``make run`` mint with,
      trusted as ``key_id`` for every org and audience and the roles of
      :data:`~services.auth.trust.OPERATOR_ROLES`;
    * ``runtime_service_key.pem`` / ``effect-owner_service_key.pem`` — each service's own
      key (``FLOW_AUTH_SERVICE_KEY``), trusted as ``<service>-service`` for every org,
      only the audiences that service calls and the one role its calls need
      (:data:`DEV_SERVICE_ROLES`);
    * ``trusted_keys.json`` — version 2 (see :mod:`services.auth.trust`). A file in the
      deprecated ``{key_id: PEM}`` form is migrated (module ``trust`` docstring).

    Existing keys are kept and missing entries added; the constraints of an entry this
    function generates are widened to what this version needs (a new role a service
    checks reaches an existing dev stack); an entry whose key differs from its file is an
    error. Safe when several services start at once on one data dir: the
    first writer of each key wins and the others read it, and every process writes the
    same merged file. Files are created ``0600`` in a ``0700`` directory.

    Raises:
        ConfigError: ``env`` is ``production`` (production keys are provisioned, never
            generated), or the existing files disagree with each other.
    """
    if env == "production":
        raise ConfigError("refusing to generate development keys with FLOW_ENV=production")
    auth_dir = Path(data_dir) / "auth"
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, trusted_path = auth_dir / DEV_SIGNING_KEY_FILE, auth_dir / TRUSTED_KEYS_FILE
    wanted: dict[str, tuple[str, KeyConstraints, Path]] = {
        key_id: (_ensure_key(key_path), DEV_OPERATOR_CONSTRAINTS, key_path)
    }
    service_paths: dict[ServiceName, Path] = {}
    for service in DEV_SERVICE_AUDIENCES:
        path = auth_dir / service_key_file(service)
        service_paths[service] = path
        wanted[service_key_id(service)] = (
            _ensure_key(path),
            _dev_service_constraints(service),
            path,
        )
    if not trusted_path.exists():
        initial = trusted_keys_document({k: (pem, c) for k, (pem, c, _) in wanted.items()})
        _create_exclusive(trusted_path, json.dumps(initial, indent=2).encode())
    raw_before = trusted_path.read_text(encoding="utf-8")
    entries = _current_entries(trusted_path, key_id)
    for kid, (pem, constraints, path) in wanted.items():
        if kid not in entries:
            entries[kid] = (pem, constraints)
        elif entries[kid][0].strip() != pem.strip():
            raise ConfigError(f"{trusted_path} holds a different key for {kid!r} than {path}")
        else:
            entries[kid] = (pem, _widened(entries[kid][1], constraints))
    document = json.dumps(trusted_keys_document(entries), indent=2)
    if document != raw_before:
        _replace_file(trusted_path, document.encode())
    return DevKeyFiles(
        key_path,
        trusted_path,
        service_paths[ServiceName.RUNTIME],
        service_paths[ServiceName.EFFECT_OWNER],
    )


def _write_temp(directory: Path, data: bytes) -> str:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")  # mkstemp creates 0600
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def _create_exclusive(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, data)
    try:
        os.link(tmp, path)  # atomic, fails if another process got there first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _replace_file(path: Path, data: bytes) -> None:
    os.replace(_write_temp(path.parent, data), path)
