"""The catalog repository: SQLAlchemy Core over the catalog schema (ARCHITECTURE §2).

Rules every method follows:

* it takes the trusted scope — the org for an org artifact, ``(org, installation)`` for a
  metadata view, the complete ``RuntimeWorkScope`` for bindings, generations, entries,
  references and runtime releases — and puts every component of it in every predicate;
  nothing is ever looked up by an id or digest alone (§8.4, §10.0);
* it opens exactly one transaction (``run_in_transaction``: whole-transaction retry on
  deadlocks and write conflicts); mutating methods record their request in the same
  transaction (``services.request_dedupe``: the original response is replayed on retry);
* inserts of identity rows are insert-if-absent (``INSERT`` + duplicate key), and every
  change of a generation is fenced by a compare-and-swap on its ``state_version`` after
  the row was locked (``SELECT … FOR UPDATE``), so concurrent builders serialize;
* existence and "no live reference" are decided by conditional writes with row counts,
  never by a locked read plus a check in Python (TiDB can lose a pessimistic lock): a
  reference or binding registration advances its referent's fence version
  (:func:`._txn.fence_referent`), a delete removes the generation or view publication only
  at the version it checked and only ``WHERE NOT EXISTS`` a live reference;
* pure decisions (the §8.2/§8.3 builder) are made by the caller's ``decide`` function on
  the state read inside the transaction; the repository only applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from catalog_svc import schema as t
from catalog_svc.domain import (
    Accepted,
    GenerationDraft,
    GenerationState,
    Rejected,
    RuntimeHandlerTuple,
    RuntimeMetadataView,
    RuntimeWorkBinding,
    RuntimeWorkScope,
    SealDecision,
    Sealed,
    SubmitDecision,
)
from catalog_svc.domain import open_generation as open_draft
from services.db import db_now, insert_if_absent, run_in_transaction
from services.errors import FailedPreconditionError, FenceLostError, NotFoundError
from services.request_dedupe import Deduplicated, RequestKey, RequestLedger

from ._rows import (
    ArtifactIntegrityError,
    diagnostics_to_json,
    dump_json,
    generation_where,
    read_binding,
    read_generation,
    read_view,
    read_view_content,
    scope_where,
)
from ._txn import (
    advance,
    fence_referent,
    fence_view_publication,
    holders,
    live,
    must_read_generation,
    read_release,
    reference_where,
    referenced,
    scope_values,
    trigger_binding_digest,
    write_entry,
)
from .records import (
    BindingRecord,
    Encoder,
    GenerationRecord,
    HolderKind,
    InstallationScope,
    ReferenceIdentity,
    ReferenceRecord,
    ReferentKind,
    ReleaseRecord,
    ViewRecord,
)

__all__ = ["CatalogRepository", "SealResult", "SubmitResult"]

#: Holders that pin a generation for work a runtime binary can claim (§8.4 release rule).
_CLAIMABLE_HOLDERS = (HolderKind.PLAN.value, HolderKind.FLOW_RUN.value)


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """A submit decision and the generation as stored after applying it."""

    decision: SubmitDecision
    generation: GenerationRecord


@dataclass(frozen=True, slots=True)
class SealResult:
    """A seal decision and the generation as stored after applying it."""

    decision: SealDecision
    generation: GenerationRecord


class CatalogRepository:
    """Persistence of bindings, metadata views, generations, references and releases."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._ledger = RequestLedger(t.catalog_requests)

    @property
    def requests(self) -> RequestLedger:
        """The request-dedupe ledger (its retention sweep purges it)."""
        return self._ledger

    @staticmethod
    async def _refuse_if_held(
        conn: AsyncConnection,
        references: Sequence[ColumnElement[bool]],
        bindings: Sequence[ColumnElement[bool]] | None,
    ) -> None:
        """Raise the ``artifact_referenced`` refusal when live references (or bindings)
        match; the caller's conditional delete re-decides on the row itself."""
        held = await holders(conn, references)
        if held:
            raise referenced(
                "metadata view" if bindings is not None else "catalog generation", held
            )
        if bindings is None:
            return
        b = t.runtime_work_bindings
        bound = (
            await conn.execute(select(func.count()).select_from(b).where(*bindings))
        ).scalar_one()
        if bound:
            raise FailedPreconditionError(
                "the metadata view is bound by a registered runtime work binding",
                reason="artifact_referenced",
                attributes={"holder_kinds": "runtime_work_binding", "holders": str(bound)},
            )

    # -- bindings ----------------------------------------------------------------------

    async def register_binding(
        self, binding: RuntimeWorkBinding, key: RequestKey, encode: Encoder[BindingRecord]
    ) -> Deduplicated[BindingRecord]:
        """Register ``binding`` (idempotent); its view must be published by its installation.

        Raises:
            NotFoundError: the installation never published the referenced view.
        """
        digest = binding.digest()
        scope = binding.work_scope()
        view_scope = InstallationScope(binding.org_id, binding.app_installation_id)

        async def work(conn: AsyncConnection) -> BindingRecord:
            # The installation's view publication must still exist: advancing its fence
            # makes a concurrent withdrawal (which deletes at the version it checked) fail.
            await fence_view_publication(conn, view_scope, binding.runtime_metadata_view_digest)
            await insert_if_absent(
                conn,
                t.runtime_work_bindings,
                {
                    **binding.to_dict(),
                    "runtime_work_binding_digest": digest,
                    "created_at": await db_now(conn),
                },
            )
            record = await read_binding(conn, scope)
            if record is None:
                raise ArtifactIntegrityError()
            return record

        return await self._ledger.execute(self._engine, key, work, encode)

    async def get_binding(self, scope: RuntimeWorkScope) -> BindingRecord | None:
        """The binding of the complete ``scope``."""

        async def work(conn: AsyncConnection) -> BindingRecord | None:
            return await read_binding(conn, scope)

        return await run_in_transaction(self._engine, work, readonly=True)

    # -- metadata views ----------------------------------------------------------------

    async def publish_view(
        self,
        scope: InstallationScope,
        view: RuntimeMetadataView,
        schema_generation: int,
        key: RequestKey,
        encode: Encoder[ViewRecord],
    ) -> Deduplicated[ViewRecord]:
        """Publish ``view`` for the installation; identical content is idempotent.

        The content is stored once per org; the installation's publication records the
        schema generation it was first published for. A repeat for the same generation
        returns it unchanged; identical content for *another* generation is refused.

        Raises:
            FailedPreconditionError: ``metadata_view_schema_generation_conflict`` — the
                installation published this content for another schema generation.
        """
        digest = view.digest()
        normalized = view.normalized()
        triggers = normalized.to_dict()["trigger_subscriptions"]

        async def work(conn: AsyncConnection) -> ViewRecord:
            now = await db_now(conn)
            await insert_if_absent(
                conn,
                t.metadata_views,
                {
                    "org_id": scope.org_id,
                    "runtime_metadata_view_digest": digest,
                    "app_installation_id": scope.app_installation_id,
                    "view_schema_version": 1,
                    "view_payload": dump_json(normalized.to_dict()),
                    "trigger_binding_digest": trigger_binding_digest(triggers),
                    "created_at": now,
                },
            )
            # Content row first, then the publication: the order a delete locks them in.
            if await read_view_content(conn, scope.org_id, digest, for_update=True) is None:
                raise ArtifactIntegrityError()
            await insert_if_absent(
                conn,
                t.metadata_view_installations,
                {
                    "org_id": scope.org_id,
                    "app_installation_id": scope.app_installation_id,
                    "runtime_metadata_view_digest": digest,
                    "schema_generation": schema_generation,
                    "created_at": now,
                },
            )
            record = await read_view(conn, scope, digest)
            if record is None:
                raise ArtifactIntegrityError()
            if record.schema_generation != schema_generation:
                # Same content, another schema generation: answering with the stored
                # publication would silently hand back a view of another generation.
                raise FailedPreconditionError(
                    "this installation already published identical view content for "
                    f"schema generation {record.schema_generation}; publish it for that "
                    "generation or use its digest",
                    reason="metadata_view_schema_generation_conflict",
                    field_path="view.schema_generation",
                    attributes={
                        "published_schema_generation": str(record.schema_generation),
                        "runtime_metadata_view_digest": digest,
                    },
                )
            return record

        return await self._ledger.execute(self._engine, key, work, encode)

    async def get_view(self, scope: InstallationScope, digest: str) -> ViewRecord | None:
        """The view ``digest`` as published by the installation of ``scope``."""

        async def work(conn: AsyncConnection) -> ViewRecord | None:
            return await read_view(conn, scope, digest)

        return await run_in_transaction(self._engine, work, readonly=True)

    async def delete_view(
        self, scope: InstallationScope, digest: str, key: RequestKey, encode: Encoder[bool]
    ) -> Deduplicated[bool]:
        """Withdraw the installation's publication of a view (and the content once no
        installation publishes it); ``False`` when it was already absent.

        Raises:
            FailedPreconditionError: a live retention reference of the installation or a
                registered work binding of the installation holds the view.
        """

        async def work(conn: AsyncConnection) -> bool:
            content = await read_view_content(conn, scope.org_id, digest, for_update=True)
            if content is None:
                return False
            m, r, b = t.metadata_view_installations, t.catalog_references, t.runtime_work_bindings
            publication = [
                m.c.org_id == scope.org_id,
                m.c.app_installation_id == scope.app_installation_id,
                m.c.runtime_metadata_view_digest == digest,
            ]
            version = (
                await conn.execute(select(m.c.state_version).where(*publication).with_for_update())
            ).scalar_one_or_none()
            if version is None:
                return False
            now = await db_now(conn)
            held_where = [
                r.c.org_id == scope.org_id,
                r.c.referent_kind == ReferentKind.METADATA_VIEW.value,
                r.c.referent_id == digest,
                r.c.app_installation_id == scope.app_installation_id,
                live(now),
            ]
            bound_where = [
                b.c.org_id == scope.org_id,
                b.c.runtime_metadata_view_digest == digest,
                b.c.app_installation_id == scope.app_installation_id,
            ]
            await self._refuse_if_held(conn, held_where, bound_where)
            # The withdrawal itself decides: at the version checked, and only while no live
            # reference or binding holds the view (row count 1).
            result = await conn.execute(
                delete(m).where(
                    *publication,
                    m.c.state_version == version,
                    ~exists().where(*held_where),
                    ~exists().where(*bound_where),
                )
            )
            if result.rowcount != 1:
                await self._refuse_if_held(conn, held_where, bound_where)
                raise FenceLostError("metadata_view_installations", digest, version, None)
            # The content goes once no installation publishes it and no binding names it.
            v = t.metadata_views
            await conn.execute(
                delete(v).where(
                    v.c.org_id == scope.org_id,
                    v.c.runtime_metadata_view_digest == digest,
                    ~exists().where(
                        m.c.org_id == scope.org_id, m.c.runtime_metadata_view_digest == digest
                    ),
                    ~exists().where(
                        b.c.org_id == scope.org_id, b.c.runtime_metadata_view_digest == digest
                    ),
                )
            )
            return True

        return await self._ledger.execute(self._engine, key, work, encode)

    # -- generations -------------------------------------------------------------------

    async def open_generation(
        self,
        scope: RuntimeWorkScope,
        generation_id: str,
        contract_version: int,
        key: RequestKey,
        encode: Encoder[GenerationRecord],
    ) -> Deduplicated[GenerationRecord]:
        """Open an empty generation bound to the registered binding of ``scope``.

        Raises:
            NotFoundError: no binding is registered under the complete scope.
            DomainValidationError: invalid generation id or contract version.
        """

        async def work(conn: AsyncConnection) -> GenerationRecord:
            binding = await read_binding(conn, scope)
            if binding is None:
                raise NotFoundError("runtime work binding", scope.runtime_work_binding_digest)
            draft = open_draft(binding.binding, generation_id, contract_version=contract_version)
            await conn.execute(
                t.capability_catalog_generations.insert().values(
                    org_id=scope.org_id,
                    app_installation_id=scope.app_installation_id,
                    runtime_capability_id=scope.runtime_capability_id,
                    runtime_work_binding_digest=scope.runtime_work_binding_digest,
                    catalog_generation_id=draft.generation_id,
                    state=GenerationState.OPEN.name,
                    state_version=1,
                    contract_version=draft.contract_version,
                    catalog_digest=None,
                    created_at=await db_now(conn),
                    sealed_at=None,
                    rejection_payload=None,
                )
            )
            return await must_read_generation(conn, scope, generation_id)

        return await self._ledger.execute(self._engine, key, work, encode)

    async def submit_entry(
        self,
        scope: RuntimeWorkScope,
        generation_id: str,
        decide: Callable[[GenerationDraft, RuntimeMetadataView], SubmitDecision],
        key: RequestKey,
        encode: Encoder[SubmitResult],
    ) -> Deduplicated[SubmitResult]:
        """Apply ``decide(draft, bound view)`` to the locked generation.

        ``Accepted`` inserts (or, binding a contract, replaces) the entry; a ``Rejected``
        that rejects the generation persists REJECTED with its diagnostics; both advance
        ``state_version`` by compare-and-swap. Other decisions write nothing.

        Raises:
            NotFoundError: no such generation in the complete scope.
        """

        async def work(conn: AsyncConnection) -> SubmitResult:
            record = await read_generation(conn, scope, generation_id, for_update=True)
            if record is None:
                raise NotFoundError("catalog generation", generation_id)
            view = await read_view_content(
                conn, scope.org_id, record.draft.binding.runtime_metadata_view_digest
            )
            if view is None:
                raise ArtifactIntegrityError()
            decision = decide(record.draft, view)
            if isinstance(decision, Accepted):
                await write_entry(
                    conn, scope, generation_id, decision.entry, replace=decision.bound_contract
                )
                await advance(conn, scope, record, {})
            elif isinstance(decision, Rejected) and decision.rejects_generation:
                await advance(
                    conn,
                    scope,
                    record,
                    {
                        "state": GenerationState.REJECTED.name,
                        "rejection_payload": diagnostics_to_json(decision.diagnostics),
                    },
                )
            else:
                return SubmitResult(decision, record)
            return SubmitResult(decision, await must_read_generation(conn, scope, generation_id))

        return await self._ledger.execute(self._engine, key, work, encode)

    async def seal_generation(
        self,
        scope: RuntimeWorkScope,
        generation_id: str,
        decide: Callable[[GenerationDraft], SealDecision],
        key: RequestKey,
        encode: Encoder[SealResult],
    ) -> Deduplicated[SealResult]:
        """Apply ``decide(draft)``; a fresh ``Sealed`` stores SEALED, digest and seal time.

        Raises:
            NotFoundError: no such generation in the complete scope.
        """

        async def work(conn: AsyncConnection) -> SealResult:
            record = await read_generation(conn, scope, generation_id, for_update=True)
            if record is None:
                raise NotFoundError("catalog generation", generation_id)
            decision = decide(record.draft)
            if not isinstance(decision, Sealed) or decision.already_sealed:
                return SealResult(decision, record)
            await advance(
                conn,
                scope,
                record,
                {
                    "state": GenerationState.SEALED.name,
                    "catalog_digest": decision.catalog_digest,
                    "sealed_at": await db_now(conn),
                },
            )
            return SealResult(decision, await must_read_generation(conn, scope, generation_id))

        return await self._ledger.execute(self._engine, key, work, encode)

    async def get_generation(
        self, scope: RuntimeWorkScope, generation_id: str
    ) -> GenerationRecord | None:
        """The generation of the complete ``scope`` (any state), digest-verified."""

        async def work(conn: AsyncConnection) -> GenerationRecord | None:
            return await read_generation(conn, scope, generation_id)

        return await run_in_transaction(self._engine, work, readonly=True)

    async def delete_generation(
        self,
        scope: RuntimeWorkScope,
        generation_id: str,
        check: Callable[[GenerationRecord], None],
        key: RequestKey,
        encode: Encoder[bool],
    ) -> Deduplicated[bool]:
        """Delete an unreferenced generation; ``False`` when already absent.

        ``check`` vets the locked generation (e.g. its catalog digest) and raises to refuse.

        Raises:
            FailedPreconditionError: a live retention reference holds the generation.
        """

        async def work(conn: AsyncConnection) -> bool:
            record = await read_generation(conn, scope, generation_id, for_update=True)
            if record is None:
                return False
            check(record)
            now = await db_now(conn)
            g, r = t.capability_catalog_generations, t.catalog_references
            referent = [
                *scope_where(r, scope),
                r.c.referent_kind == ReferentKind.CATALOG_GENERATION.value,
                r.c.referent_id == generation_id,
            ]
            await self._refuse_if_held(conn, [*referent, live(now)], None)
            # Children first (foreign keys); expired references go too; live ones never.
            for child in (t.handler_availability, t.capability_catalog_entries):
                await conn.execute(
                    delete(child).where(*generation_where(child, scope, generation_id))
                )
            await conn.execute(delete(r).where(*referent, ~live(now)))
            # The delete itself decides: at the version checked (a reference registered
            # since advanced it) and only while no live reference exists (row count 1).
            result = await conn.execute(
                delete(g).where(
                    *generation_where(g, scope, generation_id),
                    g.c.state_version == record.state_version,
                    ~exists().where(*referent, live(now)),
                )
            )
            if result.rowcount != 1:
                await self._refuse_if_held(conn, [*referent, live(now)], None)
                raise FenceLostError(
                    "capability_catalog_generations", generation_id, record.state_version, None
                )
            return True

        return await self._ledger.execute(self._engine, key, work, encode)

    # -- retention references ----------------------------------------------------------

    async def register_reference(
        self,
        scope: RuntimeWorkScope,
        identity: ReferenceIdentity,
        expires_at: datetime | None,
        catalog_digest: str | None,
        key: RequestKey,
        encode: Encoder[ReferenceRecord],
    ) -> Deduplicated[ReferenceRecord]:
        """Register a reference (idempotent on its identity; a repeat returns the stored one).

        The referent must exist in the scope: a SEALED generation with ``catalog_digest``,
        or a view published by the scope's installation. Its fence version advances in
        this transaction (a conditional UPDATE, row count 1), so a concurrent delete either
        sees this reference or fails its own conditional delete.

        Raises:
            NotFoundError: no such referent in the scope.
        """

        async def work(conn: AsyncConnection) -> ReferenceRecord:
            await fence_referent(conn, scope, identity, catalog_digest)
            r = t.catalog_references
            await insert_if_absent(
                conn,
                r,
                {
                    **scope_values(scope),
                    "referent_kind": identity.referent_kind.value,
                    "referent_id": identity.referent_id,
                    "holder_kind": identity.holder_kind.value,
                    "holder_id": identity.holder_id,
                    "expires_at": expires_at,
                    "created_at": await db_now(conn),
                },
            )
            row = (await conn.execute(select(r).where(*reference_where(scope, identity)))).one()
            return ReferenceRecord(identity, catalog_digest, row.expires_at, row.created_at)

        return await self._ledger.execute(self._engine, key, work, encode)

    async def release_reference(
        self,
        scope: RuntimeWorkScope,
        identity: ReferenceIdentity,
        key: RequestKey,
        encode: Encoder[bool],
    ) -> Deduplicated[bool]:
        """Release a reference; ``False`` when it was already absent."""

        async def work(conn: AsyncConnection) -> bool:
            result = await conn.execute(
                delete(t.catalog_references).where(*reference_where(scope, identity))
            )
            return bool(result.rowcount)

        return await self._ledger.execute(self._engine, key, work, encode)

    # -- runtime handler availability --------------------------------------------------

    async def publish_release(
        self,
        scope: RuntimeWorkScope,
        release_id: str,
        supported_capability_version: int,
        tuples: Sequence[RuntimeHandlerTuple],
        key: RequestKey,
        encode: Encoder[int],
    ) -> Deduplicated[int]:
        """Replace the release's publication within ``scope`` by ``tuples``.

        Raises:
            NotFoundError: a tuple names a generation that is not SEALED in the scope.
        """

        async def work(conn: AsyncConnection) -> int:
            for generation_id in sorted({tp.catalog_generation_id for tp in tuples}):
                record = await read_generation(conn, scope, generation_id)
                if record is None or record.draft.state is not GenerationState.SEALED:
                    raise NotFoundError("catalog generation", generation_id)
            h, rel = t.handler_availability, t.runtime_releases
            release_where = [*scope_where(rel, scope), rel.c.runtime_release_id == release_id]
            await conn.execute(
                delete(h).where(*scope_where(h, scope), h.c.runtime_binary_id == release_id)
            )
            await conn.execute(delete(rel).where(*release_where))
            now = await db_now(conn)
            await conn.execute(
                rel.insert().values(
                    **scope_values(scope),
                    runtime_release_id=release_id,
                    supported_capability_version=supported_capability_version,
                    published_at=now,
                )
            )
            if tuples:
                await conn.execute(
                    h.insert(),
                    [
                        {
                            **scope_values(scope),
                            "catalog_generation_id": tp.catalog_generation_id,
                            "action_type": tp.action_type,
                            "runtime_binary_id": release_id,
                            "handler_ref": tp.handler_ref,
                            "entry_digest": tp.entry_digest,
                            "binding_fingerprint": tp.binding_fingerprint,
                            "published_at": now,
                        }
                        for tp in tuples
                    ],
                )
            return len(tuples)

        return await self._ledger.execute(self._engine, key, work, encode)

    async def verification_inputs(
        self, scope: RuntimeWorkScope, release_id: str, generation_ids: Sequence[str]
    ) -> tuple[ReleaseRecord | None, list[tuple[str, GenerationRecord | None]]]:
        """The release's publication and the generations to verify it against.

        With no ``generation_ids``: every generation a live activated-plan or non-terminal
        run reference holds in the scope (the work the binary can claim), sorted.
        """

        async def work(
            conn: AsyncConnection,
        ) -> tuple[ReleaseRecord | None, list[tuple[str, GenerationRecord | None]]]:
            release = await read_release(conn, scope, release_id)
            wanted = list(generation_ids)
            if not wanted:
                r = t.catalog_references
                rows = await conn.execute(
                    select(r.c.referent_id)
                    .where(
                        *scope_where(r, scope),
                        r.c.referent_kind == ReferentKind.CATALOG_GENERATION.value,
                        r.c.holder_kind.in_(_CLAIMABLE_HOLDERS),
                        live(await db_now(conn)),
                    )
                    .distinct()
                )
                wanted = [row.referent_id for row in rows]
            out = [(gid, await read_generation(conn, scope, gid)) for gid in sorted(set(wanted))]
            return release, out

        return await run_in_transaction(self._engine, work, readonly=True)
