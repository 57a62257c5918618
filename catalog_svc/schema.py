"""Catalog service schema (SQLAlchemy Core): bindings, metadata views, capability catalogs.

Spec: §7.1 (``RuntimeWorkBinding``, ``RuntimeMetadataView``), §8.1-§8.4 (sealed
``FlowActionCapabilityCatalog`` generations, entries, retention, runtime availability).

Keys: ``org_id`` leads every primary key, unique key and index. Catalog artifacts are keyed
by the complete trusted work scope ``(org_id, app_installation_id, runtime_capability_id,
runtime_work_binding_digest)`` — a lookup by generation id alone is impossible (§8.4).

Plans live in the runtime service's database, so the §7.4 "enforced plan-to-generation and
plan-to-view reference" cannot be a physical foreign key across services; it is the
``catalog_references`` retention row the runtime registers (through the Catalog API) before
activating a plan, and a referenced generation or view is never deleted while it exists.

The Alembic migrations in ``catalog_svc/migrations`` must produce exactly this schema
(``python -m catalog_svc db verify``).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    text,
)

from services.db import (
    CODE_LEN,
    DIGEST_LEN,
    ID_LEN,
    KEY_LEN,
    TABLE_OPTIONS,
    TOKEN_LEN,
    WORK_SCOPE,
    JsonText,
    UtcDateTime,
    new_metadata,
    work_scope_columns,
)
from services.request_dedupe import request_dedupe_table

__all__ = [
    "MAX_CAPABILITY_DESCRIPTOR_BYTES",
    "MAX_ENTRY_PAYLOAD_BYTES",
    "MAX_METADATA_VIEW_BYTES",
    "MAX_REJECTION_PAYLOAD_BYTES",
    "capability_catalog_entries",
    "capability_catalog_generations",
    "catalog_references",
    "catalog_requests",
    "handler_availability",
    "metadata",
    "metadata_view_installations",
    "metadata_views",
    "runtime_releases",
    "runtime_work_bindings",
]

#: Upper bound of one serialized ``RuntimeMetadataView`` (object/field schema,
#: relationships, trigger subscriptions, action metadata).
MAX_METADATA_VIEW_BYTES = 8 * 1024 * 1024
#: Upper bound of one serialized L0 capability descriptor (§8.4 table).
MAX_CAPABILITY_DESCRIPTOR_BYTES = 32 * 1024
#: Upper bound of one normalized catalog entry with its digests (declared descriptor,
#: handler binding and the handler's asserted descriptor).
MAX_ENTRY_PAYLOAD_BYTES = 128 * 1024
#: Upper bound of the §8.3 diagnostics that rejected a generation.
MAX_REJECTION_PAYLOAD_BYTES = 64 * 1024

metadata = new_metadata()
_GENERATION = (*WORK_SCOPE, "catalog_generation_id")

#: Immutable, content-addressed ``RuntimeMetadataView`` artifacts.
metadata_views = Table(
    "metadata_views",
    metadata,
    Column("org_id", String(ID_LEN), nullable=False),
    Column("runtime_metadata_view_digest", String(DIGEST_LEN), nullable=False),
    Column("app_installation_id", String(ID_LEN), nullable=False),
    Column("view_schema_version", Integer, nullable=False),
    Column("view_payload", JsonText(MAX_METADATA_VIEW_BYTES), nullable=False),
    # Digest of the normalized trigger subscriptions selected from this view (§7.4).
    Column("trigger_binding_digest", String(DIGEST_LEN), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("org_id", "runtime_metadata_view_digest"),
    Index("ix_metadata_views_installation", "org_id", "app_installation_id", "created_at"),
    **TABLE_OPTIONS,
)

#: Immutable ``RuntimeWorkBinding`` tuples; the digest commits every component (§7.1).
runtime_work_bindings = Table(
    "runtime_work_bindings",
    metadata,
    *work_scope_columns(),
    Column("catalog_revision", BigInteger, nullable=False),
    Column("schema_generation", BigInteger, nullable=False),
    Column("engine_generation", BigInteger, nullable=False),
    Column("catalog_snapshot_digest", String(DIGEST_LEN), nullable=False),
    Column("runtime_metadata_view_digest", String(DIGEST_LEN), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint(*WORK_SCOPE),
    # A referenced view cannot be deleted.
    ForeignKeyConstraint(
        ["org_id", "runtime_metadata_view_digest"],
        ["metadata_views.org_id", "metadata_views.runtime_metadata_view_digest"],
    ),
    Index("ix_runtime_work_bindings_view", "org_id", "runtime_metadata_view_digest"),
    **TABLE_OPTIONS,
)

#: ``FlowActionCatalogGeneration`` (§8.4): OPEN while the builder adds entries, then SEALED
#: (``state_version`` fences the one OPEN -> SEALED transition); its content is immutable
#: once sealed. On a SEALED generation ``state_version`` keeps serving as the fence between
#: reference registration (advances it by a conditional UPDATE) and deletion (deletes only
#: at the version it checked), so the two always conflict on the row.
capability_catalog_generations = Table(
    "capability_catalog_generations",
    metadata,
    *work_scope_columns(),
    Column("catalog_generation_id", String(ID_LEN), nullable=False),
    Column("state", String(CODE_LEN), nullable=False),  # OPEN | SEALED | REJECTED
    Column("state_version", BigInteger, nullable=False),
    Column("contract_version", Integer, nullable=False),
    # Set when sealed: digest of the binding digest plus the sorted entry digests.
    Column("catalog_digest", String(DIGEST_LEN), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("sealed_at", UtcDateTime(), nullable=True),
    # Revision 0003: the §8.3 diagnostics that moved the generation to REJECTED.
    Column("rejection_payload", JsonText(MAX_REJECTION_PAYLOAD_BYTES), nullable=True),
    PrimaryKeyConstraint(*_GENERATION),
    ForeignKeyConstraint(list(WORK_SCOPE), [f"runtime_work_bindings.{c}" for c in WORK_SCOPE]),
    **TABLE_OPTIONS,
)

#: One effective action per normalized action type in a generation (§8.1, §8.3).
capability_catalog_entries = Table(
    "capability_catalog_entries",
    metadata,
    *work_scope_columns(),
    Column("catalog_generation_id", String(ID_LEN), nullable=False),
    Column("action_type", String(TOKEN_LEN), nullable=False),
    Column("owner_registration_id", String(TOKEN_LEN), nullable=False),
    Column("handler_ref", String(KEY_LEN), nullable=False),
    Column("handler_impl_version", String(ID_LEN), nullable=False),
    Column("capability_descriptor", JsonText(MAX_CAPABILITY_DESCRIPTOR_BYTES), nullable=False),
    Column("capability_descriptor_digest", String(DIGEST_LEN), nullable=False),
    Column("binding_fingerprint", String(DIGEST_LEN), nullable=False),
    Column("entry_digest", String(DIGEST_LEN), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    # Revision 0003: the complete normalized entry (owner kind, contract-only flag,
    # service-release digest, asserted capability) with its digest chain, re-verified on
    # every read; the columns above are its indexed projection. Nullable only because
    # the column was added after the table (no row predates it).
    Column("entry_payload", JsonText(MAX_ENTRY_PAYLOAD_BYTES), nullable=True),
    PrimaryKeyConstraint(*_GENERATION, "action_type"),
    ForeignKeyConstraint(
        list(_GENERATION), [f"capability_catalog_generations.{c}" for c in _GENERATION]
    ),
    **TABLE_OPTIONS,
)

#: Retention references (§7.4, §8.4): while a row exists (and ``expires_at`` is NULL or in
#: the future) the referent — a catalog generation (``referent_id`` = generation id) or a
#: metadata view (``referent_id`` = view digest) — must not be deleted. Holders are plan
#: activations, non-terminal runs and the diagnostic-retention window.
catalog_references = Table(
    "catalog_references",
    metadata,
    *work_scope_columns(),
    Column("referent_kind", String(CODE_LEN), nullable=False),  # CATALOG_GENERATION | METADATA_VIEW
    Column("referent_id", String(DIGEST_LEN), nullable=False),
    Column("holder_kind", String(CODE_LEN), nullable=False),  # PLAN | FLOW_RUN | DIAGNOSTIC
    Column("holder_id", String(TOKEN_LEN), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint(*WORK_SCOPE, "referent_kind", "referent_id", "holder_kind", "holder_id"),
    # "Is this view referenced at all?" (a view is org-scoped, not binding-scoped).
    Index("ix_catalog_references_referent", "org_id", "referent_kind", "referent_id"),
    Index("ix_catalog_references_holder", "org_id", "holder_kind", "holder_id"),
    Index("ix_catalog_references_expiry", "org_id", "expires_at"),
    **TABLE_OPTIONS,
)

#: What each runtime binary can execute within its work scope (§8.4): the exact
#: ``(binding digest, generation, action type, handler ref, entry digest, fingerprint)``.
handler_availability = Table(
    "handler_availability",
    metadata,
    *work_scope_columns(),
    Column("catalog_generation_id", String(ID_LEN), nullable=False),
    Column("action_type", String(TOKEN_LEN), nullable=False),
    Column("runtime_binary_id", String(ID_LEN), nullable=False),
    Column("handler_ref", String(KEY_LEN), nullable=False),
    Column("entry_digest", String(DIGEST_LEN), nullable=False),
    Column("binding_fingerprint", String(DIGEST_LEN), nullable=False),
    Column("published_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint(*_GENERATION, "action_type", "runtime_binary_id"),
    ForeignKeyConstraint(
        list(_GENERATION), [f"capability_catalog_generations.{c}" for c in _GENERATION]
    ),
    Index("ix_handler_availability_binary", "org_id", "runtime_binary_id"),
    **TABLE_OPTIONS,
)


#: Which installations published a content-addressed metadata view (revision 0003). The
#: view content is stored once per org (``metadata_views``); visibility is per
#: installation, so identical content published by two installations of one org never
#: discloses one installation's view to the other. ``state_version`` (revision 0004) is the
#: publication's fence: a reference registration or binding registration advances it by a
#: conditional UPDATE and a withdrawal deletes only at the version it checked, so the two
#: conflict on the row itself (ARCHITECTURE §2) instead of relying on a locked read.
metadata_view_installations = Table(
    "metadata_view_installations",
    metadata,
    Column("org_id", String(ID_LEN), nullable=False),
    Column("app_installation_id", String(ID_LEN), nullable=False),
    Column("runtime_metadata_view_digest", String(DIGEST_LEN), nullable=False),
    Column("schema_generation", BigInteger, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("org_id", "app_installation_id", "runtime_metadata_view_digest"),
    ForeignKeyConstraint(
        ["org_id", "runtime_metadata_view_digest"],
        ["metadata_views.org_id", "metadata_views.runtime_metadata_view_digest"],
    ),
    Index("ix_metadata_view_installations_view", "org_id", "runtime_metadata_view_digest"),
    **TABLE_OPTIONS,
)

#: One publication of a runtime binary release within a work scope (revision 0003): the
#: highest capability version it supports; its tuples are ``handler_availability`` rows.
runtime_releases = Table(
    "runtime_releases",
    metadata,
    *work_scope_columns(),
    Column("runtime_release_id", String(ID_LEN), nullable=False),
    Column("supported_capability_version", BigInteger, nullable=False),
    Column("published_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint(*WORK_SCOPE, "runtime_release_id"),
    ForeignKeyConstraint(list(WORK_SCOPE), [f"runtime_work_bindings.{c}" for c in WORK_SCOPE]),
    **TABLE_OPTIONS,
)

#: Request deduplication of mutating RPCs (``services.request_dedupe``; revision 0004):
#: (complete trusted scope, rpc, request_id) -> digest of the request body and the
#: original response.
catalog_requests = request_dedupe_table(metadata, "catalog_requests")
