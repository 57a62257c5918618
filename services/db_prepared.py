"""Execution helpers for statements built once, at import (hot write paths).

Building a Core statement per call (``insert(t).values({...})``, ``==`` comparisons) and
generating its cache key costs more CPU than the database round trip of a short write;
a module-level statement with bound parameters, executed with a parameter dict, hits
SQLAlchemy's compiled-statement cache directly. :func:`services.db.insert_if_absent` is
the per-call form of :func:`insert_prepared`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Executable
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from services.db import DbErrorClass, classify_db_error

__all__ = ["insert_prepared"]


async def insert_prepared(
    conn: AsyncConnection, stmt: Executable, params: Mapping[str, Any]
) -> bool:
    """Execute a pre-built ``INSERT`` of one row; ``False`` when a primary/unique key
    already holds it.

    The caller's transaction stays usable after a duplicate (MySQL/MariaDB/TiDB and
    SQLite roll back only the failed statement), exactly as with
    :func:`services.db.insert_if_absent`.
    """
    try:
        await conn.execute(stmt, dict(params))
    except DBAPIError as exc:
        if classify_db_error(exc) is DbErrorClass.DUPLICATE_KEY:
            return False
        raise
    return True
