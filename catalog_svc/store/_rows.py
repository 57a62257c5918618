"""Row <-> domain conversions and the read helpers the repository composes.

Every helper takes the caller's connection (it runs inside the caller's transaction) and
the complete trusted scope; none looks anything up by an id alone (§10.0). Stored
payloads are rebuilt through the domain's ``from_dict`` constructors, which re-verify
every digest, so a tampered or corrupted artifact is never served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, Table, select
from sqlalchemy.ext.asyncio import AsyncConnection

from catalog_svc import schema as t
from catalog_svc.domain import (
    CatalogDiagnostic,
    CatalogDigest,
    CatalogEntry,
    CatalogGenerationId,
    DiagnosticCode,
    DomainValidationError,
    GenerationDraft,
    GenerationState,
    RuntimeMetadataView,
    RuntimeWorkBinding,
    RuntimeWorkBindingDigest,
    RuntimeWorkScope,
    SealedGeneration,
)
from services.digest import canonical_json
from services.errors import FlowError

from .records import BindingRecord, GenerationRecord, InstallationScope, ViewRecord

__all__ = [
    "ArtifactIntegrityError",
    "diagnostics_from_json",
    "diagnostics_to_json",
    "dump_json",
    "generation_where",
    "read_binding",
    "read_generation",
    "read_view",
    "read_view_content",
    "scope_where",
]


class ArtifactIntegrityError(FlowError):
    """A stored artifact failed digest verification; it is never served (INTERNAL)."""

    default_message = "stored catalog artifact failed verification"
    reason = "artifact_integrity"


def dump_json(value: Any) -> str:
    """Canonical JSON text of ``value`` (what every payload column holds)."""
    return canonical_json(value).decode("utf-8")


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ArtifactIntegrityError() from exc


def scope_where(table: Table, scope: RuntimeWorkScope) -> list[ColumnElement[bool]]:
    """The four work-scope predicates on ``table``."""
    return [
        table.c.org_id == scope.org_id,
        table.c.app_installation_id == scope.app_installation_id,
        table.c.runtime_capability_id == scope.runtime_capability_id,
        table.c.runtime_work_binding_digest == scope.runtime_work_binding_digest,
    ]


def generation_where(
    table: Table, scope: RuntimeWorkScope, generation_id: str
) -> list[ColumnElement[bool]]:
    """Work scope plus generation id on ``table``."""
    return [*scope_where(table, scope), table.c.catalog_generation_id == generation_id]


def diagnostics_to_json(diagnostics: Sequence[CatalogDiagnostic]) -> str:
    """Serialized §8.3 diagnostics of a rejected generation."""
    return dump_json(
        [
            {"entry": d.entry, "field": d.field, "code": d.code.value, "message": d.message}
            for d in diagnostics
        ]
    )


def diagnostics_from_json(text: str | None) -> tuple[CatalogDiagnostic, ...]:
    """Inverse of :func:`diagnostics_to_json` (``None`` = no diagnostics)."""
    if text is None:
        return ()
    raw = _load_json(text)
    try:
        return tuple(
            CatalogDiagnostic(d["entry"], d["field"], DiagnosticCode(d["code"]), d["message"])
            for d in raw
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactIntegrityError() from exc


def _binding_from_row(row: Row[Any]) -> BindingRecord:
    binding = RuntimeWorkBinding(
        org_id=row.org_id,
        app_installation_id=row.app_installation_id,
        runtime_capability_id=row.runtime_capability_id,
        catalog_revision=row.catalog_revision,
        schema_generation=row.schema_generation,
        engine_generation=row.engine_generation,
        catalog_snapshot_digest=row.catalog_snapshot_digest,
        runtime_metadata_view_digest=row.runtime_metadata_view_digest,
    )
    if binding.digest() != row.runtime_work_binding_digest:
        raise ArtifactIntegrityError()
    digest = RuntimeWorkBindingDigest(row.runtime_work_binding_digest)
    return BindingRecord(binding, digest, row.created_at)


async def read_binding(
    conn: AsyncConnection, scope: RuntimeWorkScope, *, for_update: bool = False
) -> BindingRecord | None:
    """The binding registered under the complete ``scope``."""
    stmt = select(t.runtime_work_bindings).where(*scope_where(t.runtime_work_bindings, scope))
    if for_update:
        stmt = stmt.with_for_update()
    row = (await conn.execute(stmt)).first()
    return None if row is None else _binding_from_row(row)


async def read_view_content(
    conn: AsyncConnection, org_id: str, digest: str, *, for_update: bool = False
) -> RuntimeMetadataView | None:
    """The org's view content with ``digest`` (visibility is the caller's business)."""
    stmt = select(t.metadata_views.c.view_payload).where(
        t.metadata_views.c.org_id == org_id,
        t.metadata_views.c.runtime_metadata_view_digest == digest,
    )
    if for_update:
        stmt = stmt.with_for_update()
    payload = (await conn.execute(stmt)).scalar_one_or_none()
    if payload is None:
        return None
    try:
        view = RuntimeMetadataView.from_dict(_load_json(payload))
    except DomainValidationError as exc:
        raise ArtifactIntegrityError() from exc
    if view.digest() != digest:
        raise ArtifactIntegrityError()
    return view


async def read_view(
    conn: AsyncConnection, scope: InstallationScope, digest: str, *, for_update: bool = False
) -> ViewRecord | None:
    """The view ``digest`` as published by the installation of ``scope``."""
    m = t.metadata_view_installations
    stmt = select(m.c.schema_generation, m.c.created_at).where(
        m.c.org_id == scope.org_id,
        m.c.app_installation_id == scope.app_installation_id,
        m.c.runtime_metadata_view_digest == digest,
    )
    if for_update:
        stmt = stmt.with_for_update()
    row = (await conn.execute(stmt)).first()
    if row is None:
        return None
    view = await read_view_content(conn, scope.org_id, digest)
    if view is None:  # the foreign key makes this impossible short of corruption
        raise ArtifactIntegrityError()
    return ViewRecord(scope, digest, row.schema_generation, view, row.created_at)


def _entry_from_row(row: Row[Any]) -> CatalogEntry:
    if row.entry_payload is None:
        raise ArtifactIntegrityError()
    try:
        entry = CatalogEntry.from_dict(_load_json(row.entry_payload))
    except DomainValidationError as exc:
        raise ArtifactIntegrityError() from exc
    if entry.entry_digest != row.entry_digest or entry.action_type != row.action_type:
        raise ArtifactIntegrityError()
    return entry


async def read_generation(
    conn: AsyncConnection,
    scope: RuntimeWorkScope,
    generation_id: str,
    *,
    for_update: bool = False,
) -> GenerationRecord | None:
    """The generation ``generation_id`` of the complete ``scope``, with its entries."""
    g = t.capability_catalog_generations
    stmt = select(g).where(*generation_where(g, scope, generation_id))
    if for_update:
        stmt = stmt.with_for_update()
    row = (await conn.execute(stmt)).first()
    if row is None:
        return None
    binding = await read_binding(conn, scope)
    if binding is None:  # the foreign key makes this impossible short of corruption
        raise ArtifactIntegrityError()
    e = t.capability_catalog_entries
    entry_rows = (
        await conn.execute(
            select(e).where(*generation_where(e, scope, generation_id)).order_by(e.c.action_type)
        )
    ).all()
    entries = tuple(_entry_from_row(r) for r in entry_rows)
    created: Mapping[str, datetime] = {r.action_type: r.created_at for r in entry_rows}
    try:
        state = GenerationState[row.state]
    except KeyError as exc:
        raise ArtifactIntegrityError() from exc
    draft = GenerationDraft(
        binding=binding.binding,
        binding_digest=binding.digest,
        generation_id=CatalogGenerationId(row.catalog_generation_id),
        state=state,
        entries=entries,
        rejection=diagnostics_from_json(row.rejection_payload),
        contract_version=row.contract_version,
        catalog_digest=None if row.catalog_digest is None else CatalogDigest(row.catalog_digest),
    )
    if state is GenerationState.SEALED:
        sealed = SealedGeneration.build(
            draft.binding, draft.generation_id, draft.entries, draft.contract_version
        )
        if sealed.catalog_digest != draft.catalog_digest or sealed.verify():
            raise ArtifactIntegrityError()
    return GenerationRecord(draft, row.state_version, row.created_at, row.sealed_at, created)
