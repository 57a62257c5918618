"""Key material: Ed25519 key pairs, the trusted-keys file, development keys.

Nothing here logs or echoes key material; errors name the file, never its content.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.config import ConfigError

__all__ = [
    "DEV_SIGNING_KEY_FILE",
    "TRUSTED_KEYS_FILE",
    "DevKeyFiles",
    "ensure_dev_keys",
    "generate_keypair",
    "load_signing_key",
    "load_trusted_keys",
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


def load_trusted_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    """Read ``{key_id: public-key PEM}`` JSON.

    Raises:
        ConfigError: the file is missing, malformed, empty, or holds a non-Ed25519 key.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read trusted keys {path}: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"trusted keys {path} must be a non-empty JSON object")
    keys: dict[str, Ed25519PublicKey] = {}
    for kid, pem in raw.items():
        try:
            key = serialization.load_pem_public_key(str(pem).encode("ascii"))
        except ValueError as exc:
            raise ConfigError(f"trusted key {kid!r} in {path} is not a PEM public key") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"trusted key {kid!r} in {path} is not an Ed25519 key")
        keys[kid] = key
    return keys


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
    signing_key: Path
    trusted_keys: Path


def ensure_dev_keys(data_dir: Path, *, env: str, key_id: str = "dev") -> DevKeyFiles:
    """Create a development signing key and ``trusted_keys.json`` under ``<data_dir>/auth/``.

    Existing files are kept; a trusted-keys file lacking ``key_id`` gets it added. Safe
    when several services start at once on one data dir: the first writer wins and the
    others read its key. Files are created ``0600`` in a ``0700`` directory.

    Raises:
        ConfigError: ``env`` is ``production`` (production keys are provisioned, never
            generated), or the existing files disagree with each other.
    """
    if env == "production":
        raise ConfigError("refusing to generate development keys with FLOW_ENV=production")
    auth_dir = Path(data_dir) / "auth"
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, trusted_path = auth_dir / DEV_SIGNING_KEY_FILE, auth_dir / TRUSTED_KEYS_FILE
    if not key_path.exists():
        _create_exclusive(key_path, _private_pem(generate_keypair()[0]))
    public_pem = _public_pem(load_signing_key(key_path).public_key())
    if not trusted_path.exists():
        _create_exclusive(trusted_path, json.dumps({key_id: public_pem}, indent=2).encode())
    current = json.loads(trusted_path.read_text(encoding="utf-8"))
    if not isinstance(current, dict):
        raise ConfigError(f"{trusted_path} must be a JSON object")
    if current.get(key_id) is None:
        current[key_id] = public_pem
        _replace_file(trusted_path, json.dumps(current, indent=2).encode())
    elif current[key_id] != public_pem:
        raise ConfigError(f"{trusted_path} holds a different key for {key_id!r} than {key_path}")
    return DevKeyFiles(key_path, trusted_path)


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
