"""Catalog deletes and reference registrations decide by conditional writes with row counts
(issue 10, item 5; ARCHITECTURE §2), never by a locked read plus a check in Python.

TiDB can lose a pessimistic lock; these tests make the "lock lost" case happen on MariaDB:
between the delete's holder check and its delete, a live reference is committed by another
connection that never touches the locked row. The conditional delete still sees it and
refuses; a check-then-delete deleted the generation (and the new live reference with it).
SQLite serialises writers, so that interleaving cannot happen there. The register/delete
race through the real API is proven on both backends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pymysql
import pytest
from sqlalchemy.engine import make_url

import catalog_svc.store.repository as repository
from services.proto import catalog_v1
from tests.integration.catalog.harness import Client, Scope, demo_entries, error_detail, new_id

PLAN = catalog_v1.ReferenceHolderKind.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN


def _mariadb(catalog_db_url: str) -> Any:
    if catalog_db_url.startswith("sqlite"):
        pytest.skip("SQLite serialises writers: no transaction can commit in between")
    url = make_url(catalog_db_url)
    return pymysql.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 3306,
        user=url.username or "root",
        password=url.password or "",
        database=url.database,
        autocommit=True,
    )


@pytest.fixture
def lost_lock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], None]]]:
    """Run the queued actions once, right after the repository's next holder check (the
    moment a check-then-delete would have decided)."""
    queued: list[Callable[[], None]] = []
    original = repository.holders

    async def holders(conn: Any, where: Any) -> dict[str, int]:
        found = await original(conn, where)
        while queued:
            queued.pop(0)()
        return found

    monkeypatch.setattr(repository, "holders", holders)
    yield queued


def _insert_reference(
    admin: Any, scope: Scope, kind: str, referent: str, holder: str
) -> Callable[[], None]:
    def run() -> None:
        with admin.cursor() as cursor:
            cursor.execute(
                "INSERT INTO catalog_references (org_id, app_installation_id, "
                "runtime_capability_id, runtime_work_binding_digest, referent_kind, referent_id, "
                "holder_kind, holder_id, expires_at, created_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, 'PLAN', %s, NULL, %s)",
                (
                    scope.org_id,
                    scope.app_installation_id,
                    scope.runtime_capability_id,
                    scope.runtime_work_binding_digest,
                    kind,
                    referent,
                    holder,
                    datetime.now(UTC).replace(tzinfo=None),
                ),
            )

    return run


def _delete_generation(client: Client, scope: Scope, gen: Any) -> Any:
    return client.call(
        "DeleteGeneration",
        catalog_v1.DeleteGenerationRequest(
            request_id=new_id("req"),
            scope=scope.proto(),
            catalog_generation_id=gen.catalog_generation_id,
            catalog_digest=gen.catalog_digest,
        ),
        client.scoped(scope),
    )


def _reference_count(admin: Any, org: str) -> int:
    with admin.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM catalog_references WHERE org_id = %s", (org,))
        count: int = cursor.fetchone()[0]
        return count


def test_a_reference_committed_after_the_check_keeps_the_generation(
    client: Client, catalog_db_url: str, lost_lock: list[Callable[[], None]]
) -> None:
    admin = _mariadb(catalog_db_url)
    try:
        scope = client.tenant()
        gen = client.build(scope, demo_entries())
        lost_lock.append(
            _insert_reference(
                admin, scope, "CATALOG_GENERATION", gen.catalog_generation_id, "plan-late"
            )
        )
        with pytest.raises(grpc.RpcError) as err:
            _delete_generation(client, scope, gen)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_detail(err.value).code == "artifact_referenced"
        assert client.get_generation(scope, gen.catalog_generation_id) == gen
        assert _reference_count(admin, scope.org_id) == 1  # the live reference survived
    finally:
        admin.close()


def test_a_view_reference_committed_after_the_check_keeps_the_view(
    client: Client, catalog_db_url: str, lost_lock: list[Callable[[], None]]
) -> None:
    admin = _mariadb(catalog_db_url)
    try:
        org = new_id("org")
        view = client.publish_view(org, "inst-1")
        digest = view.runtime_metadata_view_digest
        scope = Scope(org, "inst-1", "cap-x", "unbound")
        lost_lock.append(_insert_reference(admin, scope, "METADATA_VIEW", digest, "plan-late"))
        with pytest.raises(grpc.RpcError) as err:
            client.call(
                "DeleteMetadataView",
                catalog_v1.DeleteMetadataViewRequest(
                    request_id=new_id("req"),
                    org_id=org,
                    app_installation_id="inst-1",
                    runtime_metadata_view_digest=digest,
                ),
                client.md(org, "inst-1"),
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_detail(err.value).code == "artifact_referenced"
        got = client.call(
            "GetMetadataView",
            catalog_v1.GetMetadataViewRequest(
                org_id=org, app_installation_id="inst-1", runtime_metadata_view_digest=digest
            ),
            client.md(org, "inst-1"),
        )
        assert got.view.runtime_metadata_view_digest == digest
    finally:
        admin.close()


def _race(client: Client, scope: Scope, gen: Any, holder: str) -> dict[str, Any]:
    """Register a reference and delete the generation at the same time."""
    ref = catalog_v1.ArtifactReference(
        catalog_generation=catalog_v1.GenerationTarget(
            catalog_generation_id=gen.catalog_generation_id, catalog_digest=gen.catalog_digest
        ),
        holder_kind=PLAN,
        holder_id=holder,
    )
    outcomes: dict[str, Any] = {}

    def register() -> None:
        try:
            outcomes["register"] = client.call(
                "RegisterReference",
                catalog_v1.RegisterReferenceRequest(
                    request_id=new_id("req"), scope=scope.proto(), reference=ref
                ),
                client.scoped(scope),
            )
        except grpc.RpcError as exc:
            outcomes["register"] = exc.code()

    def delete() -> None:
        try:
            outcomes["delete"] = _delete_generation(client, scope, gen).deleted
        except grpc.RpcError as exc:
            outcomes["delete"] = exc.code()

    threads = [threading.Thread(target=register), threading.Thread(target=delete)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcomes


def test_racing_registrations_and_deletes_never_leave_a_dangling_reference(
    client: Client,
) -> None:
    """Through the real API on both backends: whichever wins, a live reference never
    points at a deleted generation."""
    for round_ in range(6):
        scope = client.tenant()
        gen = client.build(scope, demo_entries()[:1])
        outcomes = _race(client, scope, gen, f"plan-{round_}")
        if outcomes["delete"] is True:
            assert outcomes["register"] == grpc.StatusCode.NOT_FOUND, outcomes
            with pytest.raises(grpc.RpcError):
                client.get_generation(scope, gen.catalog_generation_id)
        else:
            assert outcomes["delete"] == grpc.StatusCode.FAILED_PRECONDITION, outcomes
            assert outcomes["register"].reference.holder_id == f"plan-{round_}"
