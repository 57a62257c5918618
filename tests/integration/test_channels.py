"""Inter-service channels honour TLS and mTLS (issue 10, item 12).

A real catalog server (production servicers, migrated SQLite) serves TLS — and in the
second case requires client certificates — and the runtime reads a metadata view from it
through its own code path (``CatalogRecordViews`` over ``catalog_channel``, i.e. the one
factory ``services.channels.client_channel``), configured only through ``FLOW_CLIENT_TLS_*``.
Certificates are generated per test (``tests/support/pki.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from catalog_svc.app import build_services as build_catalog_services
from runtime_svc.api.records import CatalogRecordViews
from runtime_svc.catalog_client import ScopedCredentials, catalog_channel
from services import db, migrate
from services.auth import (
    CredentialSource,
    CredentialVerifier,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    generate_keypair,
)
from services.channels import client_channel
from services.config import ConfigError, ServiceConfig, ServiceName, load_config
from services.errors import UnavailableError
from services.grpc_server import RunningServer, start_server
from services.proto import catalog_v1
from tests.integration.catalog.harness import binding_proto, demo_view, new_id
from tests.support.pki import issue_pki

KEY_ID = "channels-test"
PRIVATE, PUBLIC = generate_keypair()
VERIFIER = CredentialVerifier({KEY_ID: PUBLIC}, ServiceName.CATALOG)


def _cfg(tmp_path: Path, service: ServiceName, **env: str) -> ServiceConfig:
    base = {
        "FLOW_ENV": "test",
        "FLOW_DATA_DIR": str(tmp_path / "data"),
        "FLOW_CATALOG_PORT": "0",
        "FLOW_RUNTIME_PORT": "0",
        "FLOW_CATALOG_DB_URL": f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
        "FLOW_OTEL_ENABLED": "false",
    }
    return load_config(service, base | env)


async def _catalog(tmp_path: Path, **tls: str) -> AsyncIterator[RunningServer]:
    cfg = _cfg(tmp_path, ServiceName.CATALOG, **tls)
    await migrate.upgrade(cfg.db_url, "catalog_svc")
    engine = db.create_engine(cfg.db_url, pool_size=2)
    server = await start_server(cfg, await build_catalog_services(cfg, engine), verifier=VERIFIER)
    try:
        yield server
    finally:
        await server.stop(0)
        await engine.dispose()


def _source(org: str, inst: str | None = None, cap: str | None = None) -> CredentialSource:
    claims = WorkloadClaims(
        subject="publisher",
        audiences=(ServiceName.CATALOG,),
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
    )
    return CredentialSource(PRIVATE, KEY_ID, claims)


async def _tenant(target: str, publisher_cfg: ServiceConfig) -> TrustedRuntimeWorkScope:
    """Publish the demo view and a binding through a client channel of ``publisher_cfg``."""
    org, inst, cap = new_id("org"), "inst-1", "cap-flow"
    view = demo_view()
    view.org_id, view.app_installation_id = org, inst
    async with client_channel(
        target, publisher_cfg, audience=ServiceName.CATALOG, credentials=_source(org, inst)
    ) as channel:
        stub = catalog_v1.CatalogServiceStub(channel)
        published = await stub.PublishMetadataView(
            catalog_v1.PublishMetadataViewRequest(request_id=new_id("r"), org_id=org, view=view),
            timeout=30,
        )
    digest = published.view.runtime_metadata_view_digest
    async with client_channel(
        target, publisher_cfg, audience=ServiceName.CATALOG, credentials=_source(org, inst, cap)
    ) as channel:
        stub = catalog_v1.CatalogServiceStub(channel)
        registered = await stub.RegisterWorkBinding(
            catalog_v1.RegisterWorkBindingRequest(
                request_id=new_id("r"), org_id=org, binding=binding_proto(org, inst, cap, digest)
            ),
            timeout=30,
        )
    return TrustedRuntimeWorkScope(
        org, inst, cap, registered.work_binding.runtime_work_binding_digest
    )


async def _read_view(
    runtime_cfg: ServiceConfig, target: str, scope: TrustedRuntimeWorkScope
) -> str:
    """The runtime's read of the scope's view, through its production channel."""
    channel = catalog_channel(runtime_cfg, target)
    try:
        views = CatalogRecordViews(channel, ScopedCredentials(PRIVATE, KEY_ID), timeout_s=10)
        return (await views.view_for(scope)).digest
    finally:
        await channel.close()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    return issue_pki(tmp_path)


async def test_runtime_reads_the_catalog_over_tls(tmp_path: Path, pki: dict[str, Path]) -> None:
    server_tls = {"FLOW_TLS_CERT": str(pki["server_cert"]), "FLOW_TLS_KEY": str(pki["server_key"])}
    client_tls = {"FLOW_CLIENT_TLS_CA": str(pki["ca"])}
    async for server in _catalog(tmp_path, **server_tls):
        target = f"127.0.0.1:{server.port}"
        runtime_cfg = _cfg(tmp_path, ServiceName.RUNTIME, **client_tls)
        assert runtime_cfg.client_tls
        scope = await _tenant(target, runtime_cfg)
        assert (await _read_view(runtime_cfg, target, scope)).startswith("runtime_metadata_view/")

        # Without client TLS the runtime cannot talk to a TLS catalog: a clear
        # UNAVAILABLE-class error, never INTERNAL.
        plaintext = _cfg(tmp_path, ServiceName.RUNTIME)
        with pytest.raises(UnavailableError):
            await _read_view(plaintext, target, scope)

        # A CA that did not sign the server certificate fails the handshake.
        other = issue_pki(tmp_path, prefix="other-")
        wrong_ca = _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS_CA=str(other["ca"]))
        with pytest.raises(UnavailableError):
            await _read_view(wrong_ca, target, scope)


async def test_runtime_presents_its_client_certificate_when_mtls_is_required(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    server_mtls = {
        "FLOW_TLS_CERT": str(pki["server_cert"]),
        "FLOW_TLS_KEY": str(pki["server_key"]),
        "FLOW_TLS_CLIENT_CA": str(pki["ca"]),
    }
    with_cert = {
        "FLOW_CLIENT_TLS_CA": str(pki["ca"]),
        "FLOW_CLIENT_TLS_CERT": str(pki["client_cert"]),
        "FLOW_CLIENT_TLS_KEY": str(pki["client_key"]),
    }
    async for server in _catalog(tmp_path, **server_mtls):
        target = f"127.0.0.1:{server.port}"
        runtime_cfg = _cfg(tmp_path, ServiceName.RUNTIME, **with_cert)
        scope = await _tenant(target, runtime_cfg)
        assert (await _read_view(runtime_cfg, target, scope)).startswith("runtime_metadata_view/")

        no_cert = _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS_CA=str(pki["ca"]))
        with pytest.raises(UnavailableError):
            await _read_view(no_cert, target, scope)


async def test_server_name_override_lets_a_client_dial_by_another_name(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    server_tls = {"FLOW_TLS_CERT": str(pki["server_cert"]), "FLOW_TLS_KEY": str(pki["server_key"])}
    async for server in _catalog(tmp_path, **server_tls):
        # The configured name, not the target host, is checked against the certificate.
        target = f"127.0.0.1:{server.port}"
        named = _cfg(
            tmp_path,
            ServiceName.RUNTIME,
            FLOW_CLIENT_TLS_CA=str(pki["ca"]),
            FLOW_CLIENT_TLS_SERVER_NAME="localhost",
        )
        scope = await _tenant(target, named)
        assert (await _read_view(named, target, scope)).startswith("runtime_metadata_view/")
        wrong_name = _cfg(
            tmp_path,
            ServiceName.RUNTIME,
            FLOW_CLIENT_TLS_CA=str(pki["ca"]),
            FLOW_CLIENT_TLS_SERVER_NAME="catalog.elsewhere.example",
        )
        with pytest.raises(UnavailableError):
            await _read_view(wrong_name, target, scope)


def test_client_tls_configuration_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="FLOW_CLIENT_TLS_KEY"):
        _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS_CERT="/c.pem")
    with pytest.raises(ConfigError, match="contradicts"):
        _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS="false", FLOW_CLIENT_TLS_CA="/a")
    assert _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS="true").client_tls
    assert not _cfg(tmp_path, ServiceName.RUNTIME).client_tls


def test_unreadable_tls_material_is_a_configuration_error(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, ServiceName.RUNTIME, FLOW_CLIENT_TLS_CA=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="catalog"):
        client_channel("127.0.0.1:1", cfg, audience=ServiceName.CATALOG)


async def test_plaintext_channel_attaches_the_credential_source(tmp_path: Path) -> None:
    async for server in _catalog(tmp_path):
        cfg = _cfg(tmp_path, ServiceName.RUNTIME)
        org = new_id("org")
        async with client_channel(
            f"127.0.0.1:{server.port}", cfg, audience=ServiceName.CATALOG, credentials=_source(org)
        ) as channel:
            stub = catalog_v1.CatalogServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.GetMetadataView(
                    catalog_v1.GetMetadataViewRequest(
                        org_id=org,
                        app_installation_id="inst-1",
                        runtime_metadata_view_digest="sha256:" + "0" * 64,
                    ),
                    timeout=10,
                )
        # Authenticated (not UNAUTHENTICATED): the view simply does not exist.
        assert missing.value.code() is not grpc.StatusCode.UNAUTHENTICATED
