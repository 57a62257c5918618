"""Small helpers shared by the definitions service modules: ids, page tokens, bounded JSON,
and the transaction shorthands every store uses."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.definitions.repository import to_json
from services.db import run_in_transaction, transaction
from services.errors import InvalidArgumentError

__all__ = ["Db", "bounded_json", "clamp_page_size", "decode_token", "encode_token", "new_id"]

T = TypeVar("T")


class Db:
    """``_txn`` (read-write, retried on conflicts) and ``_read`` (read-only) shorthands."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def _txn(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        return await run_in_transaction(self._engine, fn)

    async def _read(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        async with transaction(self._engine, readonly=True) as conn:
            return await fn(conn)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def encode_token(payload: Mapping[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


def decode_token(token: str, filters: Mapping[str, Any]) -> Mapping[str, Any] | None:
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        payload = json.loads(raw)
    except (binascii.Error, ValueError):
        payload = None
    if not isinstance(payload, dict) or payload.get("f") != dict(filters):
        raise InvalidArgumentError(
            "page_token is malformed or was issued for other filters", field_path="page_token"
        )
    return payload


def clamp_page_size(requested: int, default: int, maximum: int) -> int:
    if requested < 0:
        raise InvalidArgumentError("page_size must not be negative", field_path="page_size")
    return min(requested or default, maximum)


def bounded_json(values: Sequence[Mapping[str, Any]], limit: int) -> str:
    """JSON of ``values`` within ``limit`` bytes, dropping the tail with a marker."""
    text = to_json(values)
    kept = list(values)
    while len(text.encode()) > limit and kept:
        kept.pop()
        marker = {
            "severity": "info",
            "path": "flow",
            "code": "diagnostics.truncated",
            "message": f"{len(values) - len(kept)} more diagnostic(s) not stored",
            "blocker_chain": [],
        }
        text = to_json([*kept, marker])
    return text
