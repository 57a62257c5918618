"""Immutable inputs of wait decisions, cached per process: a run's plan and the wait
bounds of the policy generation its plan was compiled under (§14.4, §16.3).

Plans and policy generations never change once written, so a cached entry can never go
stale; the caches are bounded LRUs. Every read is org-scoped.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler.inputs import DEFAULT_WAIT_POLICY, FieldError, WaitPolicy
from runtime_svc.compiler.plan import ExecutionPlan
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions.policy import DEFAULT_POLICY_DOCUMENT
from runtime_svc.schema import runtime_policies
from services.db import transaction
from services.errors import NotFoundError

__all__ = ["PlanSource", "WaitBounds"]

_MAX_ENTRIES = 512


@dataclass(frozen=True)
class WaitBounds:
    """The wait bounds of one policy generation: maximum wait age and reconciliation."""

    max_wait_seconds: int
    policy: WaitPolicy


#: Bounds of a plan whose policy generation is not stored (seeded test plans).
_DEFAULT_BOUNDS = WaitBounds(int(DEFAULT_POLICY_DOCUMENT["max_wait_seconds"]), DEFAULT_WAIT_POLICY)


class _Lru:
    def __init__(self) -> None:
        self._items: OrderedDict[tuple[str, Any], Any] = OrderedDict()

    def get(self, key: tuple[str, Any]) -> Any:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: tuple[str, Any], value: Any) -> None:
        self._items[key] = value
        while len(self._items) > _MAX_ENTRIES:
            self._items.popitem(last=False)


class PlanSource:
    """Org-scoped plan and wait-bound lookups with per-process caches."""

    def __init__(self) -> None:
        self._plans = _Lru()
        self._bounds = _Lru()

    async def plan_txn(
        self, conn: AsyncConnection, org_id: str, plan_id: str
    ) -> tuple[repo.PlanRow, ExecutionPlan]:
        """The stored plan ``plan_id`` of ``org_id`` and its decoded value.

        Raises:
            NotFoundError: no such plan in the org.
        """
        key = (org_id, plan_id)
        cached = self._plans.get(key)
        if cached is not None:
            row, plan = cached
            return row, plan
        row = await repo.get_plan_txn(conn, org_id, plan_id)
        if row is None:
            raise NotFoundError("execution_plan", plan_id)
        value = (row, row.plan())
        self._plans.put(key, value)
        return value

    def cached_bounds(self, org_id: str, version: int) -> WaitBounds | None:
        """The wait bounds of policy generation ``version`` of ``org_id`` when this
        process already read them (a generation is immutable), else ``None``: a caller
        with nothing else to read skips the transaction (round 6: one read transaction
        less per effect submit)."""
        cached: WaitBounds | None = self._bounds.get((org_id, version))
        return cached

    async def bounds(self, engine: AsyncEngine, org_id: str, version: int) -> WaitBounds:
        """:meth:`bounds_txn`, in a read-only transaction only when not cached."""
        cached = self.cached_bounds(org_id, version)
        if cached is not None:
            return cached
        async with transaction(engine, readonly=True) as conn:
            return await self.bounds_txn(conn, org_id, version)

    async def bounds_txn(self, conn: AsyncConnection, org_id: str, version: int) -> WaitBounds:
        """The wait bounds of policy generation ``version`` of ``org_id`` (the defaults
        when that generation is not stored, or stores no ``waits`` section)."""
        key = (org_id, version)
        cached = self._bounds.get(key)
        if cached is not None:
            bounds: WaitBounds = cached
            return bounds
        t = runtime_policies.c
        raw = (
            await conn.execute(
                select(t.policy_payload).where(t.org_id == org_id, t.policy_version == version)
            )
        ).scalar_one_or_none()
        bounds = _DEFAULT_BOUNDS
        if raw is not None:
            doc = json.loads(raw) if isinstance(raw, str | bytes) else raw
            waits = doc.get("waits")
            try:
                policy = (
                    DEFAULT_WAIT_POLICY if waits is None else WaitPolicy.from_dict(waits, "waits")
                )
            except FieldError:
                policy = DEFAULT_WAIT_POLICY  # a stored generation was validated on write
            bounds = WaitBounds(int(doc.get("max_wait_seconds", bounds.max_wait_seconds)), policy)
        self._bounds.put(key, bounds)
        return bounds
