"""Deduplication of mutating requests on ``(trusted org, rpc, request_id)``.

The proto contract (``request_response.proto``): a retry with the same ``request_id``
returns the original response; a reuse with a different body fails with
``INVALID_ARGUMENT``. The dedupe row is written in the *same* transaction as the
mutation it records, so a lost commit response and its retry can never both apply.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from catalog_svc import schema as t
from services.db import db_now, insert_if_absent, run_in_transaction
from services.errors import InvalidArgumentError

from .records import MutationOutcome, RequestKey

__all__ = ["Encoder", "run_mutation"]

T = TypeVar("T")
#: Serializes a fresh result into the response bytes; ``None`` = do not answer with a
#: response (the service raises an error for this outcome after the commit).
Encoder = Callable[[T], bytes | None]

# A concurrent duplicate can only lose the insert race once: the retry reads the winner.
_MAX_DUPLICATE_RACES = 2


class _LostInsertRace(Exception):
    """Another transaction recorded the same request first; start over and replay it."""


async def run_mutation(
    engine: AsyncEngine,
    org_id: str,
    key: RequestKey,
    work: Callable[[AsyncConnection], Awaitable[T]],
    encode: Encoder[T],
) -> MutationOutcome[T]:
    """Run ``work`` once per ``(org, rpc, request_id)`` in one transaction with its record.

    Raises:
        InvalidArgumentError: ``request_id`` was used before with a different body.
    """

    async def txn(conn: AsyncConnection) -> MutationOutcome[T]:
        r = t.catalog_requests
        prior = (
            await conn.execute(
                select(r.c.request_digest, r.c.response_payload).where(
                    r.c.org_id == org_id,
                    r.c.rpc_name == key.rpc,
                    r.c.request_id == key.request_id,
                )
            )
        ).first()
        if prior is not None:
            if prior.request_digest != key.request_digest:
                raise InvalidArgumentError(
                    "request_id was already used for a different request",
                    reason="request_id_reused",
                    field_path="request_id",
                )
            if prior.response_payload is not None:
                return MutationOutcome(None, base64.b64decode(prior.response_payload))
        value = await work(conn)
        response = encode(value)
        if prior is None and response is not None:
            stored = base64.b64encode(response).decode("ascii") if key.store_response else None
            inserted = await insert_if_absent(
                conn,
                r,
                {
                    "org_id": org_id,
                    "rpc_name": key.rpc,
                    "request_id": key.request_id,
                    "request_digest": key.request_digest,
                    "response_payload": stored,
                    "created_at": await db_now(conn),
                },
            )
            if not inserted:
                raise _LostInsertRace
        return MutationOutcome(value, response)

    for _ in range(_MAX_DUPLICATE_RACES):
        try:
            return await run_in_transaction(engine, txn)
        except _LostInsertRace:
            continue
    return await run_in_transaction(engine, txn)
