"""The database-profile rules, on settings snapshots (no server)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from services.db_profiles import (
    RULES,
    ServerFlavor,
    ServerSettings,
    SettingProblem,
    SettingRule,
    UnsafeDatabaseSettingsError,
    check_settings,
    flavor_of,
)

#: What a MariaDB 10.11 service connection reports with the kernel's connect options.
MARIADB_OK: Mapping[str, str] = {
    "tx_isolation": "READ-COMMITTED",
    "autocommit": "OFF",
    "innodb_lock_wait_timeout": "5",
    "sql_mode": "STRICT_TRANS_TABLES,ERROR_FOR_DIVISION_BY_ZERO,NO_AUTO_CREATE_USER,"
    "NO_ENGINE_SUBSTITUTION",
    "log_bin": "OFF",
    "binlog_format": "MIXED",
    "read_only": "OFF",
    "tx_read_only": "OFF",
    "max_allowed_packet": "16777216",
}
MYSQL_OK: Mapping[str, str] = {
    **{k: v for k, v in MARIADB_OK.items() if not k.startswith("tx_")},
    "transaction_isolation": "READ-COMMITTED",
    "transaction_read_only": "OFF",
    "log_bin": "ON",
    "binlog_format": "ROW",
    "max_allowed_packet": "67108864",
}
TIDB_OK: Mapping[str, str] = {
    **MYSQL_OK,
    "log_bin": "OFF",
    "tidb_txn_mode": "pessimistic",
    "tidb_disable_txn_auto_retry": "ON",
    "tidb_constraint_check_in_place_pessimistic": "ON",
}

MARIADB = "10.11.6-MariaDB-0+deb12u1"
MYSQL = "8.0.36"
TIDB = "8.0.11-TiDB-v7.5.1"


def _problems(version: str, base: Mapping[str, str], **changes: str | None) -> list[str]:
    variables = dict(base)
    for name, value in changes.items():
        if value is None:
            variables.pop(name, None)
        else:
            variables[name] = value
    return [p.setting for p in check_settings(ServerSettings(version, variables))]


@pytest.mark.parametrize(
    ("version", "flavor"),
    [(MARIADB, ServerFlavor.MARIADB), (MYSQL, ServerFlavor.MYSQL), (TIDB, ServerFlavor.TIDB)],
)
def test_flavor_is_read_from_the_version(version: str, flavor: ServerFlavor) -> None:
    assert flavor_of(version) is flavor


@pytest.mark.parametrize(
    ("version", "variables"), [(MARIADB, MARIADB_OK), (MYSQL, MYSQL_OK), (TIDB, TIDB_OK)]
)
def test_the_documented_profiles_pass(version: str, variables: Mapping[str, str]) -> None:
    assert check_settings(ServerSettings(version, variables)) == []


@pytest.mark.parametrize(
    ("version", "base", "changes", "setting"),
    [
        ("10.5.23-MariaDB", MARIADB_OK, {}, "version"),
        ("5.7.44-log", MYSQL_OK, {}, "version"),
        ("5.7.25-TiDB-v6.1.0", TIDB_OK, {}, "version"),
        (MARIADB, MARIADB_OK, {"tx_isolation": "REPEATABLE-READ"}, "tx_isolation"),
        (MYSQL, MYSQL_OK, {"transaction_isolation": "SERIALIZABLE"}, "transaction_isolation"),
        (TIDB, TIDB_OK, {"transaction_isolation": "REPEATABLE-READ"}, "transaction_isolation"),
        (MARIADB, MARIADB_OK, {"autocommit": "ON"}, "autocommit"),
        (MARIADB, MARIADB_OK, {"innodb_lock_wait_timeout": "3600"}, "innodb_lock_wait_timeout"),
        (MARIADB, MARIADB_OK, {"innodb_lock_wait_timeout": "0"}, "innodb_lock_wait_timeout"),
        (MARIADB, MARIADB_OK, {"sql_mode": "NO_ENGINE_SUBSTITUTION"}, "sql_mode"),
        (MYSQL, MYSQL_OK, {"sql_mode": "STRICT_TRANS_TABLES"}, "sql_mode"),
        (MARIADB, MARIADB_OK, {"log_bin": "ON", "binlog_format": "STATEMENT"}, "binlog_format"),
        (MARIADB, MARIADB_OK, {"read_only": "ON"}, "read_only"),
        (MYSQL, MYSQL_OK, {"transaction_read_only": "ON"}, "transaction_read_only"),
        (MARIADB, MARIADB_OK, {"max_allowed_packet": "1048576"}, "max_allowed_packet"),
        (TIDB, TIDB_OK, {"tidb_txn_mode": "optimistic"}, "tidb_txn_mode"),
        (TIDB, TIDB_OK, {"tidb_disable_txn_auto_retry": "OFF"}, "tidb_disable_txn_auto_retry"),
        (
            TIDB,
            TIDB_OK,
            {"tidb_constraint_check_in_place_pessimistic": "OFF"},
            "tidb_constraint_check_in_place_pessimistic",
        ),
    ],
)
def test_each_unsafe_setting_is_named(
    version: str, base: Mapping[str, str], changes: dict[str, str], setting: str
) -> None:
    assert _problems(version, base, **changes) == [setting]


def test_hidden_variables_are_problems_not_passes() -> None:
    # A server (or proxy) that does not report a setting the kernel depends on is not
    # assumed to be fine.
    assert _problems(MARIADB, MARIADB_OK, tx_isolation=None, autocommit=None) == [
        "transaction_isolation",
        "autocommit",
    ]


def test_variables_tidb_dropped_or_that_are_off_by_default_are_accepted_when_absent() -> None:
    # tidb_disable_txn_auto_retry is gone from TiDB 8 (auto-retry no longer exists); the
    # empty tidb_txn_mode is the pessimistic default; binlog rules are not TiDB's.
    assert _problems(TIDB, TIDB_OK, tidb_disable_txn_auto_retry=None, tidb_txn_mode="") == []
    assert _problems(TIDB, TIDB_OK, log_bin="ON", binlog_format="STATEMENT") == []


def test_tidb_rules_do_not_apply_to_mariadb() -> None:
    assert _problems(MARIADB, MARIADB_OK, tidb_txn_mode="optimistic") == []


def test_the_error_lists_every_problem_with_what_is_needed() -> None:
    settings = ServerSettings(MARIADB, {**MARIADB_OK, "autocommit": "ON", "sql_mode": ""})
    error = UnsafeDatabaseSettingsError(settings.version, check_settings(settings))
    text = str(error)
    assert MARIADB in text
    assert "autocommit is 'ON', needs OFF on service connections" in text
    assert "sql_mode is '', needs STRICT_TRANS_TABLES" in text
    assert "docs/database-profiles.md" in text


def test_a_new_rule_is_one_more_list_entry() -> None:
    def galera_sync_wait(s: ServerSettings) -> SettingProblem | None:
        value = s.variables.get("wsrep_sync_wait", "0")
        return None if value != "0" else SettingProblem("wsrep_sync_wait", value, "1", "why")

    extra = SettingRule(
        "galera", frozenset({ServerFlavor.MARIADB}), ("wsrep_sync_wait",), galera_sync_wait
    )
    settings = ServerSettings(MARIADB, {**MARIADB_OK, "wsrep_sync_wait": "0"})
    assert check_settings(settings) == []
    assert [p.setting for p in check_settings(settings, (*RULES, extra))] == ["wsrep_sync_wait"]


def test_every_rule_is_named_once_and_declares_its_flavours() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert all(r.flavors for r in RULES)
