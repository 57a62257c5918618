"""The databases a bench section runs on: a fresh SQLite file, then — when
``FLOW_TEST_MYSQL_URL`` is set — a throwaway MariaDB database (utf8mb4_bin), dropped
afterwards. Each section passes its per-database coroutine."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import sqlalchemy as sa

from services import db

__all__ = ["on_each_database"]


async def on_each_database(prefix: str, bench: Callable[[str, str], Awaitable[None]]) -> None:
    """Await ``bench(label, url)`` on SQLite, then on a fresh MariaDB database."""
    with tempfile.TemporaryDirectory() as tmp:
        await bench("sqlite", f"sqlite+aiosqlite:///{Path(tmp) / f'{prefix}.db'}")
    mysql = os.environ.get("FLOW_TEST_MYSQL_URL")
    if not mysql:
        print("mariadb  skipped (set FLOW_TEST_MYSQL_URL=mysql+aiomysql://root:@127.0.0.1:3307)")
        return
    name = f"bench_{prefix}_{uuid.uuid4().hex[:8]}"
    admin = db.create_engine(mysql.rstrip("/") + "/", pool_size=1)
    async with admin.connect() as conn:
        await conn.execute(
            sa.text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        )
    try:
        await bench("mariadb", f"{mysql.rstrip('/')}/{name}?charset=utf8mb4")
    finally:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f"DROP DATABASE {name}"))
        await admin.dispose()
