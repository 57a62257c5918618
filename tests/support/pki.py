"""A throw-away PKI for TLS tests: a CA, a server certificate for ``localhost`` /
``127.0.0.1`` and a client certificate, written as PEM files (``cryptography``)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["issue_pki"]


def _write_pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _issue(
    name: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    usage: Any,
    san: list[Any],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def issue_pki(directory: Path, prefix: str = "") -> dict[str, Path]:
    """PEM files ``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``
    under ``directory`` (names prefixed with ``prefix``); a fresh CA every call."""
    ca_cert, ca_key = _issue("nexus-test-ca", None, None, [])
    ca = (ca_cert.subject, ca_key)
    server_san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_cert, server_key = _issue("localhost", ca, ExtendedKeyUsageOID.SERVER_AUTH, server_san)
    client_cert, client_key = _issue("runtime-worker", ca, ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    pem = serialization.Encoding.PEM
    return {
        "ca": _write_pem(directory / f"{prefix}ca.pem", ca_cert.public_bytes(pem)),
        "server_cert": _write_pem(directory / f"{prefix}server.pem", server_cert.public_bytes(pem)),
        "server_key": _write_pem(directory / f"{prefix}server.key", key_pem(server_key)),
        "client_cert": _write_pem(directory / f"{prefix}client.pem", client_cert.public_bytes(pem)),
        "client_key": _write_pem(directory / f"{prefix}client.key", key_pem(client_key)),
    }
