"""The catalog process's request-retention sweep (issue 10, item 14): dedupe rows older
than ``FLOW_REQUEST_RETENTION_HOURS`` are purged, newer ones replay; on SQLite and MariaDB."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from catalog_svc import schema
from catalog_svc.app import start_catalog_background
from services import db, migrate
from services.config import ServiceName, load_config
from services.request_dedupe import DedupeScope, RequestKey, RequestLedger
from services.request_retention import RequestRetention


async def test_the_catalog_background_purges_expired_request_rows(
    db_url: str, tmp_path: Path
) -> None:
    await migrate.upgrade(db_url, "catalog_svc")
    cfg = load_config(
        ServiceName.CATALOG,
        {
            "FLOW_DATA_DIR": str(tmp_path),
            "FLOW_CATALOG_DB_URL": db_url,
            "FLOW_REQUEST_RETENTION_HOURS": "2",
        },
    )
    engine = db.create_engine(db_url, pool_size=2)
    ledger = RequestLedger(schema.catalog_requests)
    old = RequestKey(DedupeScope("org-1", "inst-1"), "OpenGeneration", "old", "d")
    new = RequestKey(DedupeScope("org-2"), "OpenGeneration", "new", "d")
    try:
        for key in (old, new):
            await ledger.execute(engine, key, lambda c: asyncio.sleep(0), lambda v: b"r")
        async with db.transaction(engine) as conn:
            past = await db.db_now(conn) - timedelta(hours=3)
            t = schema.catalog_requests
            await conn.execute(update(t).where(t.c.request_id == "old").values(created_at=past))
        group = await start_catalog_background(cfg, engine)
        try:
            (sweep,) = group.loops
            assert isinstance(sweep, RequestRetention)
            assert sweep.retention == timedelta(hours=2)
            assert await sweep.sweep_once() == 1
        finally:
            await group.stop()
        assert await ledger.replay(engine, old) is None
        stored = await ledger.replay(engine, new)
        assert stored is not None and stored.payload == b"r"
    finally:
        await engine.dispose()
