"""Schemas and migrations: clean install, upgrade from the first revision, verify (§20.2),
and the key discipline of every table (§10.0), on SQLite and MariaDB."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, Boolean, DateTime, Integer, MetaData, SmallInteger, String, text
from sqlalchemy.schema import ForeignKeyConstraint, Index, Table, UniqueConstraint

from services import db, migrate

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("catalog_svc", "runtime_svc", "effect_owner_svc")
FIRST = "0001"

EXPECTED_TABLES = {
    "catalog_svc": {
        "runtime_work_bindings",
        "metadata_views",
        "capability_catalog_generations",
        "capability_catalog_entries",
        "catalog_references",
        "handler_availability",
        "metadata_view_installations",
        "runtime_releases",
        "catalog_requests",
    },
    "runtime_svc": {
        "flow_versions",
        "runtime_policies",
        "execution_plans",
        "plan_activations",
        "flow_runs",
        "flow_run_slots",
        "flow_step_executions",
        "flow_step_attempts",
        "flow_checkpoints",
        "flow_dependencies",
        "flow_wake_signals",
        "flow_record_watches",
        "flow_effect_links",
        "runtime_outbox",
        "records",
        "record_history_sequences",
        "business_events",
        "audit_records",
        "runtime_requests",
        # §17 principal directory (revision 0012_identity).
        "flow_principals",
        # §20 migration contract (revision 0009_legacy_bridge).
        "flow_interviews",
        "flow_deployment_control",
        "flow_interview_writers",
        "flow_interview_org_backfill_receipts",
        "flow_migration_cohorts",
        "flow_shadow_comparisons",
    },
    "effect_owner_svc": {
        "owner_inbox",
        "external_commands",
        "remote_attempts",
        "completion_receipts",
        "owner_outbox",
        "owner_requests",
    },
}

#: Spec field lists (snake_case) every table must carry.
SPEC_FIELDS = {
    ("runtime_svc", "flow_runs"): (  # §10.1 + §18.2 projection
        "org_id plan_id execution_profile execution_owner runtime_state "
        "current_step_execution_id current_checkpoint_id state_version ownership_epoch "
        "run_after queue_class priority terminal_cause_code delete_requested_at started_at "
        "completed_at is_deleted idempotency_key interview_status current_element paused_at"
    ),
    ("runtime_svc", "flow_step_executions"): (  # §10.2
        "org_id step_execution_id flow_run_id plan_step_key invocation_ordinal step_kind "
        "state input_checkpoint_id output_checkpoint_id state_version attempt_count "
        "lease_owner lease_token lease_until ownership_epoch run_after queue_class "
        "failure_class created_at updated_at"
    ),
    ("runtime_svc", "flow_step_attempts"): (  # §10.3
        "org_id attempt_id step_execution_id attempt_number lease_token_digest "
        "ownership_epoch root_state_version_at_claim started_at finished_at "
        "transaction_outcome failure_class safe_error_code retry_decision "
        "retry_policy_digest recovery_backoff_floor_ms attempt_state_version plan_digest "
        "lock_plan_digest trace_id metrics_summary"
    ),
    ("runtime_svc", "flow_checkpoints"): (  # §10.4
        "org_id checkpoint_id flow_run_id sequence plan_cursor context_schema_version "
        "context_payload context_digest read_verification_set created_by_attempt_id created_at"
    ),
    ("runtime_svc", "flow_dependencies"): (  # §10.5
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "dependency_id flow_run_id step_execution_id producer_kind producer_key "
        "condition_digest state wake_version wake_token deadline next_probe_at "
        "expiry_policy resolved_at resolution_receipt reconciliation_attempts wake_signal_id"
    ),
    ("runtime_svc", "flow_wake_signals"): (  # §10.6
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "wake_signal_id producer_kind producer_key wake_token wake_version evidence_digest "
        "evidence_reference received_at expires_at resolution_state dependency_id "
        "evidence_json next_match_at consumed_at"
    ),
    ("runtime_svc", "runtime_outbox"): (  # §10.7 + delivery state
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "runtime_outbox_message_id message_family effect_handoff_key effect_owner_kind "
        "payload_schema_version payload_digest flow_run_id step_execution_id "
        "submission_attempt_id deadline failure_policy delivery_state delivery_attempts "
        "next_attempt_at lease_until"
    ),
    ("runtime_svc", "flow_effect_links"): (  # §10.8
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "effect_link_id flow_run_id step_execution_id effect_owner_kind "
        "runtime_outbox_message_id effect_handoff_key submission_attempt_id created_at"
    ),
    ("runtime_svc", "execution_plans"): (  # §7.4
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest plan_id "
        "flow_version_id metadata_digest compiler_version catalog_generation_id "
        "catalog_digest catalog_revision schema_generation engine_generation "
        "catalog_snapshot_digest runtime_metadata_view_digest trigger_binding_digest "
        "policy_version execution_profile plan_digest plan_payload bound_summary "
        "diagnostic_summary created_at"
    ),
    ("catalog_svc", "capability_catalog_generations"): (  # §8.4
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "catalog_generation_id catalog_digest contract_version state sealed_at created_at"
    ),
    ("effect_owner_svc", "owner_inbox"): (  # §10.7 fence row
        "org_id app_installation_id runtime_capability_id runtime_work_binding_digest "
        "effect_handoff_key runtime_outbox_message_id payload_digest state"
    ),
}

#: Tables exempt from "org_id leads every key and is NOT NULL" (§10.0), each for a reason
#: the spec gives: the pre-bridge FlowInterview shape whose OrgID is nullable only in the
#: additive window (§20.2), and deployment-scoped control-plane rows (the write-protocol
#: control record, the writer fleet, the org-backfill receipts) that are about the
#: deployment, not about one tenant — the deployment's org is a value they prove.
NOT_ORG_SCOPED = {
    ("runtime_svc", "flow_interviews"),
    ("runtime_svc", "flow_deployment_control"),
    ("runtime_svc", "flow_interview_writers"),
    ("runtime_svc", "flow_interview_org_backfill_receipts"),
}

# InnoDB and TiDB limit an index key to 3072 bytes; utf8mb4 reserves 4 bytes a character.
_MAX_KEY_BYTES = 3072


def _metadata(service_pkg: str) -> MetaData:
    metadata: MetaData = importlib.import_module(f"{service_pkg}.schema").metadata
    return metadata


def _tables() -> list[tuple[str, Table]]:
    return [(s, t) for s in SERVICES for t in _metadata(s).sorted_tables]


def _keys(table: Table) -> list[tuple[str, list[str]]]:
    """Every primary key, unique key, index and foreign key of ``table`` with its columns."""
    keys = [("primary key", [c.name for c in table.primary_key.columns])]
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint | ForeignKeyConstraint):
            keys.append((f"{constraint.name}", [c.name for c in constraint.columns]))
    for index in table.indexes:
        keys.append((f"{index.name}", [c.name for c in index.columns]))
    return keys


def _column_bytes(column_type: object) -> int:
    if isinstance(column_type, db.AsciiId):
        return 4 * db.ID_LEN  # as utf8mb4: TiDB keeps these columns utf8mb4 (ADR 0015)
    if isinstance(column_type, String):
        assert column_type.length is not None
        return 4 * column_type.length
    if isinstance(column_type, db.UtcDateTime | DateTime):
        return 8
    for kind, size in ((BigInteger, 8), (SmallInteger, 2), (Integer, 4), (Boolean, 1)):
        if isinstance(column_type, kind):
            return size
    raise AssertionError(f"no key size for {column_type!r}")


# --- pure checks of the models ---------------------------------------------------------


@pytest.mark.parametrize("service_pkg", SERVICES)
def test_each_service_declares_exactly_its_tables(service_pkg: str) -> None:
    assert set(_metadata(service_pkg).tables) == EXPECTED_TABLES[service_pkg]


@pytest.mark.parametrize(("service_pkg", "table"), sorted(SPEC_FIELDS))
def test_tables_carry_the_spec_fields(service_pkg: str, table: str) -> None:
    columns = set(_metadata(service_pkg).tables[table].c.keys())
    missing = set(SPEC_FIELDS[(service_pkg, table)].split()) - columns
    assert not missing, f"{table} lacks {sorted(missing)}"


def test_org_id_leads_every_primary_key_unique_key_index_and_foreign_key() -> None:
    offenders = [
        f"{service}.{table.name}: {what} {columns}"
        for service, table in _tables()
        if (service, table.name) not in NOT_ORG_SCOPED
        for what, columns in _keys(table)
        if not columns or columns[0] != "org_id"
    ]
    assert offenders == []


def test_every_table_has_a_non_null_org_id_and_no_auto_increment() -> None:
    for service, table in _tables():
        assert table.autoincrement_column is None, f"{service}.{table.name}"
        if (service, table.name) in NOT_ORG_SCOPED:
            continue
        assert "org_id" in table.c, f"{service}.{table.name}"
        assert table.c.org_id.nullable is False, f"{service}.{table.name}"


def test_the_only_nullable_org_id_is_the_pre_bridge_interview_shape() -> None:
    nullable = {
        (service, table.name)
        for service, table in _tables()
        if "org_id" in table.c and table.c.org_id.nullable
    }
    # flow_interview_org_backfill_receipts names the proven org (NULL when quarantined).
    assert nullable == {
        ("runtime_svc", "flow_interviews"),
        ("runtime_svc", "flow_interview_org_backfill_receipts"),
    }


def test_every_key_fits_the_innodb_and_tidb_key_length_limit() -> None:
    for service, table in _tables():
        for what, columns in _keys(table):
            size = sum(_column_bytes(table.c[name].type) for name in columns)
            assert size <= _MAX_KEY_BYTES, f"{service}.{table.name} {what}: {size} bytes"


def test_every_foreign_key_is_served_by_an_explicit_key_prefix() -> None:
    # Otherwise MySQL adds an implicit index of its own, which `verify` would report.
    for service, table in _tables():
        prefixes = [columns for what, columns in _keys(table) if not what.startswith("fk_")]
        for fk in table.foreign_key_constraints:
            wanted = [c.name for c in fk.columns]
            assert any(p[: len(wanted)] == wanted for p in prefixes), f"{service}.{fk.name}"


def test_constraint_and_index_names_are_explicit_and_fit_mysql_identifiers() -> None:
    for service, table in _tables():
        named = [*table.indexes, *(c for c in table.constraints if not isinstance(c, Index))]
        for item in named:
            assert item.name, f"{service}.{table.name}: unnamed {type(item).__name__}"
            assert len(item.name) <= 64, f"{service}.{item.name}"


def test_fenced_rows_have_a_bigint_version() -> None:
    for service, table in _tables():
        for name in ("state_version", "attempt_state_version", "record_version"):
            if name in table.c:
                assert isinstance(table.c[name].type, BigInteger), f"{service}.{table.name}"
                assert table.c[name].nullable is False


# --- migrations against real databases -------------------------------------------------


@pytest.mark.parametrize("service_pkg", SERVICES)
async def test_clean_install_reaches_head_and_verifies_clean(db_url: str, service_pkg: str) -> None:
    await migrate.upgrade(db_url, service_pkg)

    assert await migrate.current(db_url, service_pkg) == migrate.heads(service_pkg)
    assert await migrate.verify(db_url, service_pkg) == []
    await migrate.upgrade(db_url, service_pkg)  # idempotent at head
    assert await migrate.verify(db_url, service_pkg) == []


@pytest.mark.parametrize("service_pkg", SERVICES)
async def test_upgrade_from_the_first_revision_then_verify(db_url: str, service_pkg: str) -> None:
    await migrate.upgrade(db_url, service_pkg, FIRST)

    assert await migrate.current(db_url, service_pkg) == [FIRST]
    problems = await migrate.verify(db_url, service_pkg)
    assert (
        problems[0] == f"database is at revision ['{FIRST}'], head is {migrate.heads(service_pkg)}"
    )
    assert any(p.startswith("add_table: ") for p in problems[1:])

    await migrate.upgrade(db_url, service_pkg)
    assert await migrate.verify(db_url, service_pkg) == []


@pytest.mark.parametrize("service_pkg", SERVICES)
async def test_downgrade_to_the_first_revision_and_back(db_url: str, service_pkg: str) -> None:
    await migrate.upgrade(db_url, service_pkg)
    await migrate.downgrade(db_url, service_pkg, FIRST)
    assert await migrate.current(db_url, service_pkg) == [FIRST]

    await migrate.upgrade(db_url, service_pkg)
    assert await migrate.verify(db_url, service_pkg) == []


async def test_concurrent_upgrades_from_several_processes_are_serialised(db_url: str) -> None:
    # Replicas starting with FLOW_DB_AUTO_MIGRATE=true at the same moment.
    code = "import asyncio, sys; from services import migrate; " + (
        "asyncio.run(migrate.upgrade(sys.argv[1], 'runtime_svc'))"
    )
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, db_url, cwd=ROOT, stderr=asyncio.subprocess.PIPE
        )
        for _ in range(3)
    ]
    results = [await asyncio.wait_for(p.communicate(), timeout=60) for p in procs]

    assert [p.returncode for p in procs] == [0, 0, 0], [err.decode() for _, err in results]
    assert await migrate.verify(db_url, "runtime_svc") == []


async def test_verify_reports_drift(db_url: str) -> None:
    from runtime_svc import schema

    await migrate.upgrade(db_url, "runtime_svc")
    engine = db.create_engine(db_url)
    history = next(i for i in schema.flow_runs.indexes if i.name == "ix_flow_runs_history")
    try:
        async with db.transaction(engine) as conn:
            await conn.run_sync(history.drop)
            await conn.execute(text("ALTER TABLE records ADD COLUMN stray INTEGER"))
    finally:
        await engine.dispose()

    problems = await migrate.verify(db_url, "runtime_svc")

    assert len(problems) == 2
    assert any("add_index" in p and "ix_flow_runs_history" in p for p in problems)
    assert any("remove_column" in p and "records.stray" in p for p in problems)


def test_db_command_line(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert migrate.main(["upgrade", "--revision", FIRST], "effect_owner_svc", db_url) == 0
    assert migrate.main(["current"], "effect_owner_svc", db_url) == 0
    assert f"at {FIRST} (head {migrate.heads('effect_owner_svc')[0]})" in capsys.readouterr().out

    assert migrate.main(["verify"], "effect_owner_svc", db_url) == 1
    assert "add_table: table owner_outbox" in capsys.readouterr().out

    assert migrate.main(["upgrade"], "effect_owner_svc", db_url) == 0
    assert migrate.main(["verify"], "effect_owner_svc", db_url) == 0
    assert "schema matches the models at head" in capsys.readouterr().out
    assert migrate.main(["frobnicate"], "effect_owner_svc", db_url) == 2


@pytest.mark.parametrize("service_pkg", SERVICES)
def test_each_service_has_one_linear_migration_head(service_pkg: str) -> None:
    assert len(migrate.heads(service_pkg)) == 1
