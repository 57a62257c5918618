"""Responses never exceed the message limit (issue 10, item 9), through a real catalog
whose ``FLOW_GRPC_MAX_MESSAGE_BYTES`` is small: a list pages by bytes as well as by count,
a read whose answer is too large is ``OUT_OF_RANGE``, and a mutation whose response would
be too large is refused inside its transaction, so nothing is written."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import func, select

from catalog_svc.app import build_services
from catalog_svc.schema import metadata_views
from services import db, migrate
from services.auth import CredentialVerifier, generate_keypair
from services.config import ServiceName, load_config
from services.grpc_server import start_server
from services.proto import catalog_v1
from tests.integration.catalog.harness import (
    KEY_ID,
    Client,
    demo_view,
    entry,
    error_detail,
    new_id,
    pure_descriptor,
)

MAX_BYTES = 8 * 1024
F = catalog_v1.FieldType


class _Catalog:
    """The production catalog wiring with a small message limit, in a background loop."""

    def __init__(self, db_url: str, data_dir: Path) -> None:
        self.db_url, self.data_dir = db_url, data_dir
        self.private_key, public = generate_keypair()
        self.verifier = CredentialVerifier({KEY_ID: public}, ServiceName.CATALOG)
        self.port = 0
        self._ready, self._stop = threading.Event(), None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        cfg = load_config(
            ServiceName.CATALOG,
            {
                "FLOW_ENV": "test",
                "FLOW_DATA_DIR": str(self.data_dir),
                "FLOW_CATALOG_PORT": "0",
                "FLOW_CATALOG_DB_URL": self.db_url,
                "FLOW_GRPC_MAX_MESSAGE_BYTES": str(MAX_BYTES),
                "FLOW_OTEL_ENABLED": "false",
            },
        )
        engine = db.create_engine(self.db_url, pool_size=2)
        server = await start_server(cfg, await build_services(cfg, engine), verifier=self.verifier)
        self.port = server.port
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)
        await engine.dispose()

    def __enter__(self) -> _Catalog:
        asyncio.run(migrate.upgrade(self.db_url, "catalog_svc"))
        self._thread.start()
        assert self._ready.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[tuple[Client, str]]:
    with (
        _Catalog(db_url, tmp_path) as catalog,
        grpc.insecure_channel(f"127.0.0.1:{catalog.port}") as channel,
    ):
        yield Client(channel, catalog.private_key), db_url


def test_list_entries_pages_by_bytes_and_returns_every_entry(client: tuple[Client, str]) -> None:
    c, _ = client
    scope = c.tenant()
    actions = [f"core.act_{i:02d}_{'x' * 60}" for i in range(40)]
    sealed = c.build(scope, [entry(a, pure_descriptor()) for a in actions])
    token, seen, pages = "", [], 0
    while True:
        resp = c.call(
            "ListEntries",
            catalog_v1.ListEntriesRequest(
                scope=scope.proto(),
                catalog_generation_id=sealed.catalog_generation_id,
                catalog_digest=sealed.catalog_digest,
                page_size=500,
                page_token=token,
            ),
            c.scoped(scope),
        )
        assert resp.ByteSize() <= MAX_BYTES
        seen += [e.action_type for e in resp.entries]
        pages += 1
        token = resp.next_page_token
        if not token:
            break
    assert seen == sorted(actions)
    assert pages > 1  # 40 entries do not fit one 8 KiB answer


def _big_view(fields: int) -> catalog_v1.MetadataView:
    view = demo_view()
    view.objects[0].fields.extend(
        catalog_v1.FieldSchema(api_name=f"Field{i:03d}_{'y' * 40}", type=F.FIELD_TYPE_STRING)
        for i in range(fields)
    )
    return view


def _views(db_url: str) -> int:
    async def count() -> int:
        engine = db.create_engine(db_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                query = select(func.count()).select_from(metadata_views)
                return int((await conn.execute(query)).scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(count())


def test_a_mutation_whose_response_would_not_fit_writes_nothing(
    client: tuple[Client, str],
) -> None:
    c, db_url = client
    org = new_id("org")
    # The request fits; the answer (the view plus digest, installation and time) does not.
    view, extra = _big_view(0), 0
    while True:
        extra += 1
        candidate = _big_view(extra)
        req = catalog_v1.PublishMetadataViewRequest(request_id="r" * 40, org_id=org, view=candidate)
        if req.ByteSize() > MAX_BYTES - 40:
            break
        view = candidate
    before = _views(db_url)
    with pytest.raises(grpc.RpcError) as err:
        c.publish_view(org, "inst-1", view)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert error_detail(err.value).code == "response_too_large"
    assert _views(db_url) == before


def test_a_request_over_the_limit_is_resource_exhausted_before_any_code_runs(
    client: tuple[Client, str],
) -> None:
    c, db_url = client
    before = _views(db_url)
    with pytest.raises(grpc.RpcError) as err:
        c.publish_view(new_id("org"), "inst-1", _big_view(300))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _views(db_url) == before
