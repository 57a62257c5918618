"""``python -m services.healthcheck``: the container/exec-probe health check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, free_port, running_service, service_env

pytestmark = pytest.mark.e2e


def _check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.healthcheck", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_serving_is_exit_0_and_unreachable_is_exit_1(tmp_path: Path) -> None:
    with running_service(tmp_path, "effect-owner") as svc:
        ok = _check(svc.env, "--service", "effect-owner")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == f"127.0.0.1:{svc.port}: SERVING"
        named = _check(svc.env, "--service", "effect-owner", "--name", "nope.Service")
        assert named.returncode == 1 and "NOT_FOUND" in named.stderr, named
    dead = _check(service_env(tmp_path, "runtime", free_port()), "--service", "runtime")
    assert dead.returncode == 1 and "UNAVAILABLE" in dead.stderr, dead


def test_bad_configuration_or_tls_files_are_exit_2(tmp_path: Path) -> None:
    env = service_env(tmp_path, "catalog", free_port())
    missing_ca = _check(env, "--service", "catalog", "--tls-ca", str(tmp_path / "none.pem"))
    assert missing_ca.returncode == 2 and "none.pem" in missing_ca.stderr, missing_ca
    bad = _check({**env, "FLOW_CATALOG_PORT": "port"}, "--service", "catalog")
    assert bad.returncode == 2 and "FLOW_CATALOG_PORT" in bad.stderr, bad


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """One certificate for localhost that is its own CA and allows server and client auth."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_under_mtls_the_check_speaks_tls_and_presents_the_pod_certificate(
    tmp_path: Path,
) -> None:
    from tests.support.procs import ServiceProcess, wait_until

    cert, key = _self_signed(tmp_path)
    port = free_port()
    tls = {"FLOW_TLS_CERT": str(cert), "FLOW_TLS_KEY": str(key), "FLOW_TLS_CLIENT_CA": str(cert)}
    env = service_env(tmp_path, "catalog", port, extra=tls)
    svc = ServiceProcess("catalog", port, env, tmp_path / "catalog.log").start()
    try:
        args = ("--service", "catalog", "--tls-ca", str(cert), "--tls-server-name", "localhost")
        wait_until(lambda: _check(env, *args).returncode == 0, timeout=60, what="TLS SERVING")
        assert _check(env, "--service", "catalog").returncode == 1  # plaintext is refused
        no_client_cert = {k: v for k, v in env.items() if k != "FLOW_TLS_CLIENT_CA"}
        assert _check(no_client_cert, *args).returncode == 1  # mTLS needs the certificate
    finally:
        svc.kill()
