"""Transaction helpers of :class:`~catalog_svc.store.repository.CatalogRepository`.

Each helper runs inside the caller's transaction (STYLE 6) and takes the complete
trusted scope; the repository's public methods compose them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from catalog_svc import schema as t
from catalog_svc.domain import (
    CatalogEntry,
    GenerationState,
    RuntimeHandlerTuple,
    RuntimeWorkScope,
)
from services.db import cas_update, db_now
from services.digest import versioned_digest
from services.errors import FailedPreconditionError, NotFoundError

from ._rows import (
    ArtifactIntegrityError,
    dump_json,
    generation_where,
    read_generation,
    scope_where,
)
from .records import (
    GenerationRecord,
    InstallationScope,
    ReferenceIdentity,
    ReferentKind,
    ReleaseRecord,
)

__all__ = [
    "advance",
    "fence_referent",
    "fence_view_publication",
    "holders",
    "live",
    "must_read_generation",
    "read_release",
    "reference_where",
    "referenced",
    "scope_values",
    "trigger_binding_digest",
    "write_entry",
]


def live(now: datetime) -> ColumnElement[bool]:
    """A retention reference that still holds at ``now`` (no expiry, or a later one)."""
    c = t.catalog_references.c
    return or_(c.expires_at.is_(None), c.expires_at > now)


def scope_values(scope: RuntimeWorkScope) -> dict[str, str]:
    """The four work-scope columns of a row inserted under ``scope``."""
    return {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
    }


def trigger_binding_digest(triggers: object) -> str:
    """Digest of a view's normalized trigger subscriptions (§7.4 TriggerBindingDigest)."""
    return versioned_digest("trigger_binding", triggers)


async def must_read_generation(
    conn: AsyncConnection, scope: RuntimeWorkScope, generation_id: str
) -> GenerationRecord:
    """A generation this transaction just wrote or locked (absence is corruption)."""
    record = await read_generation(conn, scope, generation_id)
    if record is None:
        raise ArtifactIntegrityError()
    return record


async def advance(
    conn: AsyncConnection,
    scope: RuntimeWorkScope,
    record: GenerationRecord,
    values: dict[str, object],
) -> None:
    """The fence: ``state_version`` CAS on the OPEN generation read in this transaction."""
    g = t.capability_catalog_generations
    await cas_update(
        conn,
        g,
        org_id=scope.org_id,
        key={
            "app_installation_id": scope.app_installation_id,
            "runtime_capability_id": scope.runtime_capability_id,
            "runtime_work_binding_digest": scope.runtime_work_binding_digest,
            "catalog_generation_id": record.draft.generation_id,
        },
        expected_version=record.state_version,
        values=values,
        extra_predicates=[g.c.state == GenerationState.OPEN.name],
    )


async def write_entry(
    conn: AsyncConnection,
    scope: RuntimeWorkScope,
    generation_id: str,
    entry: CatalogEntry,
    *,
    replace: bool,
) -> None:
    """Insert an admitted entry, or replace the contract-only entry it binds."""
    hb = entry.handler_binding
    values = {
        "owner_registration_id": entry.owner.registration_id,
        "handler_ref": "" if hb is None else hb.handler_ref,
        "handler_impl_version": "" if hb is None else hb.handler_implementation_version or "",
        "capability_descriptor": dump_json(entry.descriptor.to_dict()),
        "capability_descriptor_digest": entry.descriptor_digest,
        "binding_fingerprint": entry.binding_fingerprint or "",
        "entry_digest": entry.entry_digest,
        "entry_payload": dump_json(entry.to_dict()),
    }
    e = t.capability_catalog_entries
    if replace:
        await conn.execute(
            update(e)
            .where(*generation_where(e, scope, generation_id), e.c.action_type == entry.action_type)
            .values(values)
        )
        return
    await conn.execute(
        e.insert().values(
            **scope_values(scope),
            catalog_generation_id=generation_id,
            action_type=entry.action_type,
            created_at=await db_now(conn),
            **values,
        )
    )


async def holders(conn: AsyncConnection, where: Sequence[ColumnElement[bool]]) -> dict[str, int]:
    """Holder kind -> count of the retention references matching ``where``."""
    r = t.catalog_references
    rows = await conn.execute(
        select(r.c.holder_kind, func.count()).where(*where).group_by(r.c.holder_kind)
    )
    return {row[0]: int(row[1]) for row in rows}


def referenced(what: str, held: dict[str, int]) -> FailedPreconditionError:
    """The refusal to delete an artifact that live references hold."""
    kinds = ",".join(sorted(held))
    return FailedPreconditionError(
        f"the {what} is held by a live retention reference ({kinds})",
        reason="artifact_referenced",
        attributes={"holder_kinds": kinds, "holders": str(sum(held.values()))},
    )


def reference_where(
    scope: RuntimeWorkScope, identity: ReferenceIdentity
) -> list[ColumnElement[bool]]:
    """Predicates selecting exactly one reference by its identity within ``scope``."""
    r = t.catalog_references
    return [
        *scope_where(r, scope),
        r.c.referent_kind == identity.referent_kind.value,
        r.c.referent_id == identity.referent_id,
        r.c.holder_kind == identity.holder_kind.value,
        r.c.holder_id == identity.holder_id,
    ]


async def fence_view_publication(
    conn: AsyncConnection, scope: InstallationScope, digest: str
) -> None:
    """Advance the installation's publication of view ``digest`` by a conditional UPDATE
    (row count 1), so a concurrent withdrawal that checked the older version fails.

    Raises:
        NotFoundError: the installation does not publish the view.
    """
    m = t.metadata_view_installations
    result = await conn.execute(
        update(m)
        .where(
            m.c.org_id == scope.org_id,
            m.c.app_installation_id == scope.app_installation_id,
            m.c.runtime_metadata_view_digest == digest,
        )
        .values(state_version=m.c.state_version + 1)
    )
    if result.rowcount != 1:
        raise NotFoundError("metadata view", digest)


async def fence_referent(
    conn: AsyncConnection,
    scope: RuntimeWorkScope,
    identity: ReferenceIdentity,
    catalog_digest: str | None,
) -> None:
    """The referent of a new reference must still exist: one conditional UPDATE of its
    fence version — a SEALED generation with ``catalog_digest``, or the installation's
    publication of the view — whose row count must be 1. A concurrent delete that checked
    the older version then deletes nothing (its own conditional DELETE fails), whatever
    happened to the locks (ARCHITECTURE §2: never a locked read plus a Python check).

    Raises:
        NotFoundError: no such referent in the scope.
    """
    if identity.referent_kind is ReferentKind.METADATA_VIEW:
        view_scope = InstallationScope(scope.org_id, scope.app_installation_id)
        await fence_view_publication(conn, view_scope, identity.referent_id)
        return
    g = t.capability_catalog_generations
    result = await conn.execute(
        update(g)
        .where(
            *generation_where(g, scope, identity.referent_id),
            g.c.state == GenerationState.SEALED.name,
            g.c.catalog_digest == catalog_digest,
        )
        .values(state_version=g.c.state_version + 1)
    )
    if result.rowcount != 1:
        raise NotFoundError("catalog generation", identity.referent_id)


async def read_release(
    conn: AsyncConnection, scope: RuntimeWorkScope, release_id: str
) -> ReleaseRecord | None:
    """The release's publication within ``scope`` with its tuples, if any."""
    rel, h = t.runtime_releases, t.handler_availability
    row = (
        await conn.execute(
            select(rel).where(*scope_where(rel, scope), rel.c.runtime_release_id == release_id)
        )
    ).first()
    if row is None:
        return None
    rows = await conn.execute(
        select(h)
        .where(*scope_where(h, scope), h.c.runtime_binary_id == release_id)
        .order_by(h.c.catalog_generation_id, h.c.action_type)
    )
    tuples = tuple(
        RuntimeHandlerTuple(
            r.runtime_work_binding_digest,
            r.catalog_generation_id,
            r.action_type,
            r.handler_ref,
            r.entry_digest,
            r.binding_fingerprint,
        )
        for r in rows
    )
    return ReleaseRecord(release_id, row.supported_capability_version, tuples, row.published_at)
