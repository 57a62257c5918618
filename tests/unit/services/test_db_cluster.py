"""The Galera rules of the cluster profile (``services.db_cluster``, pure)."""

from __future__ import annotations

import pytest

from services.db_cluster import (
    SESSION_SETTINGS,
    ClusterSettingsError,
    SettingProblem,
    galera_problems,
    parse_provider_options,
)

GOOD_VARIABLES = {
    "wsrep_on": "ON",
    "wsrep_provider": "/usr/lib/galera/libgalera_smm.so",
    "wsrep_provider_options": "gcache.size = 64M; repl.commit_order = 3; repl.key_format = FLAT8",
    "binlog_format": "ROW",
    "wsrep_forced_binlog_format": "NONE",
    "wsrep_desync": "OFF",
    "innodb_autoinc_lock_mode": "2",
}
GOOD_STATUS = {"wsrep_ready": "ON", "wsrep_cluster_status": "Primary", "wsrep_cluster_size": "3"}
GOOD_SESSION = {"wsrep_sync_wait": "1", "wsrep_osu_method": "TOI", "wsrep_dirty_reads": "OFF"}


def _problems(**changes: dict[str, str]) -> list[SettingProblem]:
    return galera_problems(
        {**GOOD_VARIABLES, **changes.get("variables", {})},
        {**GOOD_STATUS, **changes.get("status", {})},
        {**GOOD_SESSION, **changes.get("session", {})},
    )


def test_a_healthy_node_has_no_problem() -> None:
    assert _problems() == []
    # Extra sync-wait bits the operator asked for globally are kept, not a problem.
    assert _problems(session={"wsrep_sync_wait": "7"}) == []
    # binlog_format may be overridden by wsrep_forced_binlog_format=ROW.
    assert (
        _problems(variables={"binlog_format": "MIXED", "wsrep_forced_binlog_format": "ROW"}) == []
    )


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"variables": {"wsrep_on": "OFF"}}, "wsrep_on"),
        ({"status": {"wsrep_cluster_status": "non-Primary"}}, "wsrep_cluster_status"),
        ({"status": {"wsrep_ready": "OFF"}}, "wsrep_cluster_status"),
        ({"variables": {"binlog_format": "STATEMENT"}}, "binlog_format"),
        (
            {"variables": {"wsrep_provider_options": "repl.commit_order = 1"}},
            "wsrep_provider_options repl.commit_order",
        ),
        ({"session": {"wsrep_sync_wait": "0"}}, "wsrep_sync_wait"),
        ({"session": {"wsrep_sync_wait": "6"}}, "wsrep_sync_wait"),
        ({"session": {"wsrep_sync_wait": "?"}}, "wsrep_sync_wait"),
        ({"session": {"wsrep_osu_method": "RSU"}}, "wsrep_OSU_method"),
        ({"session": {"wsrep_dirty_reads": "ON"}}, "wsrep_dirty_reads"),
    ],
)
def test_each_fencing_breaker_is_fatal_and_named(
    changes: dict[str, dict[str, str]], setting: str
) -> None:
    problems = _problems(**changes)
    assert [p.setting for p in problems] == [setting]
    assert problems[0].fatal
    error = ClusterSettingsError(problems)
    assert setting in str(error) and error.problems == problems


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"variables": {"wsrep_desync": "ON"}}, "wsrep_desync"),
        ({"variables": {"innodb_autoinc_lock_mode": "1"}}, "innodb_autoinc_lock_mode"),
        ({"status": {"wsrep_cluster_size": "2"}}, "wsrep_cluster_size"),
    ],
)
def test_weaker_settings_are_warnings(changes: dict[str, dict[str, str]], setting: str) -> None:
    problems = _problems(**changes)
    assert [(p.setting, p.fatal) for p in problems] == [(setting, False)]


def test_provider_options_parse() -> None:
    parsed = parse_provider_options(GOOD_VARIABLES["wsrep_provider_options"])
    assert parsed["repl.commit_order"] == "3"
    assert parsed["gcache.size"] == "64M"
    assert parse_provider_options("") == {}


def test_session_settings_turn_on_causal_reads_without_narrowing_the_global_value() -> None:
    settings = dict(SESSION_SETTINGS)
    assert settings["wsrep_sync_wait"] == "@@global.wsrep_sync_wait | 1"
    assert settings["wsrep_OSU_method"] == "'TOI'"
