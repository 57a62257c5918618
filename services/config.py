"""Configuration from environment variables.

Every setting the three services read lives here, with its default, so the
README's configuration table and the code cannot drift apart
(``tests/unit/services/test_config.py`` checks that every variable named here
appears in the README).

A service builds one :class:`ServiceConfig` at start-up with
:func:`load_config` and passes it down; nothing else reads ``os.environ``
except the fault hooks, which must be readable before any config exists, and
the runtime's worker settings (``runtime_svc.worker.settings``, the
``FLOW_RUNTIME_*`` rows of :data:`ENV_VARS`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

__all__ = [
    "ENV_VARS",
    "ConfigError",
    "ServiceConfig",
    "ServiceName",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration variable is missing or malformed."""


class ServiceName(StrEnum):
    """The three deployable services; the value is the credential audience."""

    CATALOG = "catalog"
    RUNTIME = "runtime"
    EFFECT_OWNER = "effect-owner"


_DEFAULT_PORTS: Mapping[ServiceName, int] = {
    ServiceName.CATALOG: 50061,
    ServiceName.RUNTIME: 50062,
    ServiceName.EFFECT_OWNER: 50063,
}

_DB_VARS: Mapping[ServiceName, str] = {
    ServiceName.CATALOG: "FLOW_CATALOG_DB_URL",
    ServiceName.RUNTIME: "FLOW_RUNTIME_DB_URL",
    ServiceName.EFFECT_OWNER: "FLOW_EFFECT_DB_URL",
}

_PORT_VARS: Mapping[ServiceName, str] = {
    ServiceName.CATALOG: "FLOW_CATALOG_PORT",
    ServiceName.RUNTIME: "FLOW_RUNTIME_PORT",
    ServiceName.EFFECT_OWNER: "FLOW_EFFECT_PORT",
}

_DB_FILES: Mapping[ServiceName, str] = {
    ServiceName.CATALOG: "catalog.db",
    ServiceName.RUNTIME: "runtime.db",
    ServiceName.EFFECT_OWNER: "effect_owner.db",
}

#: Every environment variable read by the services: name -> (default, meaning).
#: The README's configuration table is generated from / checked against this.
ENV_VARS: Mapping[str, tuple[str, str]] = {
    "FLOW_ENV": (
        "development",
        "`development`, `test` or `production`; production refuses fault hooks and dev keys",
    ),
    "FLOW_DATA_DIR": ("./.data", "directory for embedded SQLite files and dev keys"),
    "FLOW_LISTEN_HOST": ("127.0.0.1", "address the gRPC server binds"),
    "FLOW_CATALOG_PORT": ("50061", "catalog service gRPC port (0 = pick a free port)"),
    "FLOW_RUNTIME_PORT": ("50062", "runtime service gRPC port (0 = pick a free port)"),
    "FLOW_EFFECT_PORT": ("50063", "effect-owner service gRPC port (0 = pick a free port)"),
    "FLOW_CATALOG_DB_URL": (
        "sqlite+aiosqlite:///$FLOW_DATA_DIR/catalog.db",
        "catalog database URL (`sqlite+aiosqlite://…` or `mysql+aiomysql://…`)",
    ),
    "FLOW_RUNTIME_DB_URL": (
        "sqlite+aiosqlite:///$FLOW_DATA_DIR/runtime.db",
        "runtime database URL",
    ),
    "FLOW_EFFECT_DB_URL": (
        "sqlite+aiosqlite:///$FLOW_DATA_DIR/effect_owner.db",
        "effect-owner database URL",
    ),
    "FLOW_CATALOG_TARGET": (
        "",
        "host:port the runtime dials for the catalog (default 127.0.0.1:$FLOW_CATALOG_PORT)",
    ),
    "FLOW_DB_AUTO_MIGRATE": ("true", "run `db upgrade` at start-up before serving"),
    "FLOW_DB_POOL_SIZE": ("10", "connection pool size (MySQL/MariaDB/TiDB)"),
    "FLOW_AUTH_TRUSTED_KEYS": (
        "$FLOW_DATA_DIR/auth/trusted_keys.json",
        "JSON file `{key_id: public-key PEM}` of workload-credential issuers the server trusts",
    ),
    "FLOW_AUTH_SIGNING_KEY": (
        "$FLOW_DATA_DIR/auth/dev_signing_key.pem",
        "Ed25519 private key PEM used by clients (flowctl, tests) to mint credentials",
    ),
    "FLOW_AUTH_SIGNING_KEY_ID": ("dev", "key id written into minted credentials"),
    "FLOW_AUTH_CLOCK_SKEW_S": (
        "30",
        "tolerated clock skew when checking credential expiry, seconds",
    ),
    "FLOW_TLS_CERT": ("", "server certificate PEM; with FLOW_TLS_KEY enables TLS"),
    "FLOW_TLS_KEY": ("", "server private key PEM"),
    "FLOW_TLS_CLIENT_CA": (
        "",
        "CA bundle PEM; when set the server requires client certificates (mTLS)",
    ),
    "FLOW_GRPC_MAX_MESSAGE_BYTES": ("4194304", "maximum inbound/outbound gRPC message size"),
    "FLOW_SHUTDOWN_GRACE_S": ("10", "seconds in-flight RPCs get to finish after SIGTERM"),
    "FLOW_OTEL_ENABLED": (
        "true",
        "instrument gRPC with OpenTelemetry (spans exported only when an exporter is configured)",
    ),
    "FLOW_OTEL_CONSOLE_EXPORT": ("false", "export spans to stderr (debugging)"),
    "FLOW_LOG_LEVEL": ("INFO", "Python log level"),
    "FLOW_CRASH_AT": (
        "",
        "fault hook: SIGKILL the process at the named point (tests only; refused in production)",
    ),
    "FLOW_RUNTIME_WORKERS": ("1", "runtime: step-worker tasks in this process (0 = off)"),
    "FLOW_RUNTIME_SWEEPS": (
        "true",
        "runtime: run lease-recovery and cancellation-cleanup sweeps in this process",
    ),
    "FLOW_RUNTIME_LEASE_MS": ("60000", "runtime: claim lease duration"),
    "FLOW_RUNTIME_RETRY_BASE_MS": ("1000", "runtime: retry backoff base (jittered exponential)"),
    "FLOW_RUNTIME_RETRY_MAX_MS": ("300000", "runtime: retry backoff cap"),
    "FLOW_RUNTIME_MAX_ATTEMPTS": ("5", "runtime: attempts per step before terminal failure"),
    "FLOW_RUNTIME_IDLE_MS": ("500", "runtime: longest idle backoff of a worker with no work"),
    "FLOW_RUNTIME_SWEEP_MS": ("1000", "runtime: sweep interval"),
    "FLOW_RUNTIME_RETENTION_DAYS": (
        "30",
        "runtime: terminal runs older than this are physically purged (Flow lineage only)",
    ),
    "FLOW_RUNTIME_LEGACY_SCHEDULER": (
        "true",
        "runtime: run the LegacyInterpreter scheduler (due list, stale-claim recovery) here",
    ),
    "FLOW_RUNTIME_VIEW_FILE": (
        "",
        "tests/dev only: a metadata-view JSON used for every scope instead of the catalog",
    ),
    "FLOW_CRASH_MARKER_FILE": (
        "",
        "fault hook: file the process appends the crash point to (fsync) before it SIGKILLs itself",
    ),
}


def _get(env: Mapping[str, str], name: str) -> str:
    default, _ = ENV_VARS[name]
    value = env.get(name)
    if value is None or value == "":
        return default
    return value


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = _get(env, name).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = _get(env, name)
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from exc
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _expand(value: str, data_dir: Path) -> str:
    return value.replace("$FLOW_DATA_DIR", str(data_dir))


@dataclass(frozen=True)
class ServiceConfig:
    """Settings for one service process."""

    service: ServiceName
    env: str
    data_dir: Path
    listen_host: str
    port: int
    db_url: str
    db_auto_migrate: bool
    db_pool_size: int
    auth_trusted_keys: Path
    auth_signing_key: Path
    auth_signing_key_id: str
    auth_clock_skew_s: int
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    grpc_max_message_bytes: int
    shutdown_grace_s: float
    otel_enabled: bool
    otel_console_export: bool
    log_level: str
    catalog_target: str = field(default="127.0.0.1:50061")
    crash_at: str = field(default="")

    @property
    def is_production(self) -> bool:
        return self.env == "production"


def load_config(service: ServiceName, env: Mapping[str, str] | None = None) -> ServiceConfig:
    """Read the configuration of ``service`` from ``env`` (default ``os.environ``).

    Raises:
        ConfigError: a variable is malformed or TLS is half-configured.
    """
    e: Mapping[str, str] = os.environ if env is None else env
    flow_env = _get(e, "FLOW_ENV")
    if flow_env not in ("development", "test", "production"):
        raise ConfigError(f"FLOW_ENV must be development, test or production, got {flow_env!r}")
    data_dir = Path(_get(e, "FLOW_DATA_DIR"))
    db_var = _DB_VARS[service]
    db_url = _expand(_get(e, db_var), data_dir)
    if not (db_url.startswith("sqlite+aiosqlite://") or db_url.startswith("mysql+aiomysql://")):
        raise ConfigError(f"{db_var} must be a sqlite+aiosqlite:// or mysql+aiomysql:// URL")

    def _opt_path(name: str) -> Path | None:
        raw = _get(e, name)
        return Path(raw) if raw else None

    tls_cert, tls_key = _opt_path("FLOW_TLS_CERT"), _opt_path("FLOW_TLS_KEY")
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("FLOW_TLS_CERT and FLOW_TLS_KEY must be set together")
    tls_client_ca = _opt_path("FLOW_TLS_CLIENT_CA")
    if tls_client_ca is not None and tls_cert is None:
        raise ConfigError("FLOW_TLS_CLIENT_CA (mTLS) needs FLOW_TLS_CERT and FLOW_TLS_KEY")

    port_var = _PORT_VARS[service]
    port = _int(e, port_var)
    if port > 65535:
        raise ConfigError(f"{port_var} must be <= 65535, got {port}")

    return ServiceConfig(
        service=service,
        env=flow_env,
        data_dir=data_dir,
        listen_host=_get(e, "FLOW_LISTEN_HOST"),
        port=port,
        db_url=db_url,
        db_auto_migrate=_bool(e, "FLOW_DB_AUTO_MIGRATE"),
        db_pool_size=_int(e, "FLOW_DB_POOL_SIZE", minimum=1),
        auth_trusted_keys=Path(_expand(_get(e, "FLOW_AUTH_TRUSTED_KEYS"), data_dir)),
        auth_signing_key=Path(_expand(_get(e, "FLOW_AUTH_SIGNING_KEY"), data_dir)),
        auth_signing_key_id=_get(e, "FLOW_AUTH_SIGNING_KEY_ID"),
        auth_clock_skew_s=_int(e, "FLOW_AUTH_CLOCK_SKEW_S"),
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        grpc_max_message_bytes=_int(e, "FLOW_GRPC_MAX_MESSAGE_BYTES", minimum=1024),
        shutdown_grace_s=float(_int(e, "FLOW_SHUTDOWN_GRACE_S")),
        otel_enabled=_bool(e, "FLOW_OTEL_ENABLED"),
        otel_console_export=_bool(e, "FLOW_OTEL_CONSOLE_EXPORT"),
        log_level=_get(e, "FLOW_LOG_LEVEL").upper(),
        catalog_target=_get(e, "FLOW_CATALOG_TARGET")
        or f"127.0.0.1:{_int(e, 'FLOW_CATALOG_PORT')}",
        crash_at=_get(e, "FLOW_CRASH_AT"),
    )
