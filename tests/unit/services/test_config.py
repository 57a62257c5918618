"""Configuration: defaults, validation, and the README table staying in step."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import ENV_VARS, ConfigError, ServiceName, load_config

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_use_embedded_sqlite_per_service() -> None:
    urls = {load_config(s, {}).db_url for s in ServiceName}
    assert len(urls) == 3
    assert all(u.startswith("sqlite+aiosqlite:///") for u in urls)


def test_every_variable_is_documented_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [name for name in ENV_VARS if f"`{name}`" not in readme]
    assert missing == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FLOW_ENV": "staging"}, "FLOW_ENV"),
        ({"FLOW_RUNTIME_PORT": "http"}, "FLOW_RUNTIME_PORT"),
        ({"FLOW_RUNTIME_PORT": "70000"}, "FLOW_RUNTIME_PORT"),
        ({"FLOW_RUNTIME_DB_URL": "postgresql://x"}, "FLOW_RUNTIME_DB_URL"),
        ({"FLOW_TLS_CERT": "/c.pem"}, "FLOW_TLS_KEY"),
        ({"FLOW_TLS_CLIENT_CA": "/ca.pem"}, "FLOW_TLS_CLIENT_CA"),
        ({"FLOW_DB_AUTO_MIGRATE": "maybe"}, "FLOW_DB_AUTO_MIGRATE"),
    ],
)
def test_malformed_values_are_rejected_with_the_variable_named(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(ServiceName.RUNTIME, env)


@pytest.mark.parametrize("driver", ["asyncmy", "aiomysql"])
def test_both_mysql_drivers_are_accepted_and_another_is_named_in_the_refusal(driver: str) -> None:
    url = f"mysql+{driver}://u:p@db:3306/runtime"
    assert load_config(ServiceName.RUNTIME, {"FLOW_RUNTIME_DB_URL": url}).db_url == url
    with pytest.raises(ConfigError, match=r"mysql\+asyncmy:// or mysql\+aiomysql://"):
        load_config(ServiceName.RUNTIME, {"FLOW_RUNTIME_DB_URL": "mysql+mysqldb://u@db/rt"})


def test_data_dir_expands_into_default_paths() -> None:
    cfg = load_config(ServiceName.CATALOG, {"FLOW_DATA_DIR": "/srv/flow"})
    assert cfg.db_url == "sqlite+aiosqlite:////srv/flow/catalog.db"
    assert cfg.auth_trusted_keys == Path("/srv/flow/auth/trusted_keys.json")
