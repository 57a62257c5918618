"""Storage of runtime policy generations (§16.3): seed on first use, publish new ones.

Generations are immutable rows; see :mod:`runtime_svc.definitions.policy` for what a
generation holds and why every document change is a new generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.definitions import repository as repo
from runtime_svc.definitions._util import Db
from runtime_svc.definitions.policy import (
    PolicyGeneration,
    default_policy_generation,
    normalize_policy_document,
    policy_document_digest,
)
from services.db import db_now
from services.errors import ConflictError

__all__ = ["PolicyStore"]


class PolicyStore(Db):
    """Policy generations of every org in one database."""

    async def current(self, org_id: str) -> PolicyGeneration:
        """The org's newest policy generation; the default is seeded on first use."""

        async def txn(conn: AsyncConnection) -> PolicyGeneration:
            current = await repo.latest_policy_txn(conn, org_id)
            if current is not None:
                return current
            seed = default_policy_generation(org_id)
            if not await repo.insert_policy_txn(conn, seed, await db_now(conn)):
                # A concurrent first use seeded it; read what won.
                current = await repo.latest_policy_txn(conn, org_id)
                if current is not None:
                    return current
            return seed

        async def read(conn: AsyncConnection) -> PolicyGeneration | None:
            return await repo.latest_policy_txn(conn, org_id)

        existing = await self._read(read)
        return existing if existing is not None else await self._txn(txn)

    async def put(self, org_id: str, document: Mapping[str, Any]) -> PolicyGeneration:
        """Publish a policy document: a new generation when it differs from the current one.

        Raises:
            InvalidArgumentError: the document is not a valid policy.
            ConflictError: a concurrent publication took the next version number.
        """
        doc = normalize_policy_document(document)
        current = await self.current(org_id)
        if current.same_document(doc):
            return current

        async def txn(conn: AsyncConnection) -> PolicyGeneration:
            latest = await repo.latest_policy_txn(conn, org_id)
            base = latest or current
            if base.same_document(doc):
                return base
            new = PolicyGeneration(org_id, base.version + 1, doc, policy_document_digest(doc))
            if not await repo.insert_policy_txn(conn, new, await db_now(conn)):
                raise ConflictError(
                    f"policy version {new.version} was published concurrently; re-read and retry",
                    entity="RuntimePolicy",
                    key=str(new.version),
                )
            return new

        return await self._txn(txn)
