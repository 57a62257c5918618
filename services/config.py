"""Configuration from environment variables.

Every setting the three services read lives here, with its default, so the
README's configuration table and the code cannot drift apart
(``tests/unit/services/test_config.py`` checks that every variable named here
appears in the README).

A service builds one :class:`ServiceConfig` at start-up with
:func:`load_config` and passes it down; nothing else reads ``os.environ``
except the fault hooks, which must be readable before any config exists. The
runtime's worker settings (``runtime_svc.worker.settings.WorkerSettings``) are
derived from the ``runtime_*`` fields here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from services import event_loop as loops

__all__ = [
    "ENV_VARS",
    "MAX_WORKER_PROCESSES",
    "ConfigError",
    "EffectOwnerSettings",
    "OutboxSettings",
    "ServiceConfig",
    "ServiceName",
    "SmtpSettings",
    "TelemetrySettings",
    "WebhookSettings",
    "event_loop_choice",
    "load_config",
    "load_effect_owner_settings",
    "load_outbox_settings",
    "mail_sink_dir",
    "parse_kind_map",
    "usable_cores",
    "worker_processes",
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

#: The database URLs a service accepts: the embedded SQLite file, or a MySQL-protocol
#: server (MariaDB, TiDB) through asyncmy or aiomysql (``services/db_mysql.py``).
_DB_URL_PREFIXES = ("sqlite+aiosqlite://", "mysql+asyncmy://", "mysql+aiomysql://")

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
        "catalog database URL (`sqlite+aiosqlite://…` or `mysql+asyncmy://…`)",
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
        "JSON file of the workload-credential issuer keys the server trusts and the orgs, "
        "audiences and roles each may sign (format: README, Authentication)",
    ),
    "FLOW_AUTH_SIGNING_KEY": (
        "$FLOW_DATA_DIR/auth/dev_signing_key.pem",
        "Ed25519 private key PEM used by clients (flowctl, tests) to mint credentials",
    ),
    "FLOW_AUTH_SIGNING_KEY_ID": ("dev", "key id written into minted credentials"),
    "FLOW_AUTH_SERVICE_KEY": (
        "$FLOW_DATA_DIR/auth/<service>_service_key.pem",
        "Ed25519 private key PEM this service signs its own calls to other services with "
        "(runtime -> catalog); its trusted-keys entry limits it to what the service needs",
    ),
    "FLOW_AUTH_SERVICE_KEY_ID": (
        "<service>-service",
        "key id written into the credentials signed with FLOW_AUTH_SERVICE_KEY",
    ),
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
    "FLOW_CLIENT_TLS": (
        "false",
        "dial other services over TLS (implied by FLOW_CLIENT_TLS_CA or FLOW_CLIENT_TLS_CERT); "
        "system roots when no CA is given",
    ),
    "FLOW_CLIENT_TLS_CA": (
        "",
        "CA bundle PEM that verifies the servers this process dials (turns client TLS on)",
    ),
    "FLOW_CLIENT_TLS_CERT": (
        "",
        "client certificate PEM presented to servers that require mTLS (with FLOW_CLIENT_TLS_KEY)",
    ),
    "FLOW_CLIENT_TLS_KEY": ("", "client private key PEM for mTLS"),
    "FLOW_CLIENT_TLS_SERVER_NAME": (
        "",
        "expected server name in the dialled servers' certificates when it differs from the "
        "target host (e.g. dialling by IP)",
    ),
    "FLOW_GRPC_MAX_MESSAGE_BYTES": ("4194304", "maximum inbound/outbound gRPC message size"),
    "FLOW_SHUTDOWN_GRACE_S": ("10", "seconds in-flight RPCs get to finish after SIGTERM"),
    "FLOW_OTEL_ENABLED": (
        "true",
        "tracing on: OpenTelemetry spans (gRPC server and client, step attempts, outbox, "
        "effects, waits) and W3C trace context stored with runs, outbox messages, commands "
        "and wake signals; `false` = no spans, no propagation (see FLOW_OTEL_EXPORTER)",
    ),
    "FLOW_OTEL_EXPORTER": (
        "none",
        "where spans go: `otlp` (the standard `OTEL_EXPORTER_OTLP_*` variables: endpoint, "
        "protocol `http/protobuf` or `grpc`, headers, TLS), `console` (stderr) or `none` "
        "(trace ids are still minted and propagated)",
    ),
    "FLOW_OTEL_CONSOLE_EXPORT": (
        "false",
        "deprecated: `true` means FLOW_OTEL_EXPORTER=console (logged as a warning)",
    ),
    "FLOW_OTEL_SQL": (
        "false",
        "one span per SQL statement (opentelemetry-instrumentation-sqlalchemy); verbose, "
        "for diagnosis",
    ),
    "FLOW_METRICS_PORT": (
        "",
        "Prometheus `/metrics` port of this process on FLOW_LISTEN_HOST (empty = no "
        "endpoint, 0 = pick a free port and log it); every process has its own",
    ),
    "FLOW_METRICS_STATE_MS": (
        "15000",
        "period of the bounded authoritative-state scan behind the state gauges (run "
        "counts, queue and dependency ages, outbox and command backlogs, divergence, dual "
        "ownership); 0 = off (set it on one replica per database)",
    ),
    "FLOW_METRICS_STATE_ORGS": (
        "50",
        "orgs one state-scan pass refreshes (the scan rotates over every org)",
    ),
    "FLOW_METRICS_COUNT_CAP": (
        "10000",
        "largest count one state gauge reads per org and state (a gauge at the cap "
        "means at least that many)",
    ),
    "FLOW_METRICS_PROBE_WINDOW": (
        "500",
        "runs per org one pass checks for projection divergence and dual ownership "
        "(a keyset window; every run is checked across passes)",
    ),
    "FLOW_LOG_LEVEL": ("INFO", "Python log level"),
    "FLOW_EVENT_LOOP": (
        "auto",
        "asyncio event loop of the process: `auto` = uvloop when installed (it is a "
        "dependency on Linux/macOS), else the standard library's; `uvloop`; `asyncio`",
    ),
    "FLOW_CRASH_AT": (
        "",
        "fault hook: SIGKILL the process at the named point (tests only; refused in production)",
    ),
    "FLOW_RUNTIME_WORKERS": (
        "1",
        "runtime: step-worker tasks in each process that executes steps (0 = off)",
    ),
    "FLOW_RUNTIME_WORKER_PROCESSES": (
        "0",
        "runtime: worker processes this process starts and supervises (`python -m runtime_svc "
        "worker --supervised`, each with FLOW_RUNTIME_WORKERS tasks; this process then runs "
        "no step workers itself); `auto` = one per usable core; 0 = execute steps in-process",
    ),
    "FLOW_RUNTIME_SWEEPS": (
        "true",
        "runtime: run lease-recovery and cancellation-cleanup sweeps in this process",
    ),
    "FLOW_RUNTIME_LEASE_MS": ("60000", "runtime: claim lease duration"),
    "FLOW_RUNTIME_RETRY_BASE_MS": ("1000", "runtime: retry backoff base (jittered exponential)"),
    "FLOW_RUNTIME_RETRY_MAX_MS": ("300000", "runtime: retry backoff cap"),
    "FLOW_RUNTIME_MAX_ATTEMPTS": (
        "5",
        "runtime: attempts per step before a retryable failure is terminal (a step resumed "
        "after its wait is claimed whatever its count)",
    ),
    "FLOW_RUNTIME_IDLE_MS": ("500", "runtime: longest idle backoff of a worker with no work"),
    "FLOW_RUNTIME_SWEEP_MS": ("1000", "runtime: sweep interval"),
    "FLOW_RUNTIME_PRECLAIM_WAKE": (
        "true",
        "runtime: a wait resolution claims the resumed step (Running) for a local worker "
        "with room in its own transaction (docs/adr/0007); false = publish a wakeup hint",
    ),
    "FLOW_RUNTIME_REAUTH_CACHE_MS": (
        "5000",
        "runtime: how long a worker reuses a principal-directory state when a durable step "
        "reauthorizes (§17.2; the staleness bound of a disable or permission change; 0 = "
        "read it for every step)",
    ),
    "FLOW_RUNTIME_RETENTION_DAYS": (
        "30",
        "runtime: terminal runs older than this are physically purged (Flow lineage only)",
    ),
    "FLOW_RUNTIME_WAIT_SWEEP_MS": (
        "1000",
        "runtime: period of the wake reconciler and the wait expiry/repair sweeps (jittered)",
    ),
    "FLOW_RUNTIME_WAIT_BATCH": (
        "100",
        "runtime: rows one wait sweep handles per org (bounds a sweep's cost)",
    ),
    "FLOW_RUNTIME_SIGNAL_KINDS": (
        "external.signal",
        "runtime: external signal producer kinds `SubmitWakeSignal` accepts (comma separated)",
    ),
    "FLOW_RUNTIME_LEGACY_SCHEDULER": (
        "true",
        "runtime: run the LegacyInterpreter scheduler (due list, stale-claim recovery) here",
    ),
    "FLOW_RUNTIME_VIEW_FILE": (
        "",
        "tests/dev only: a metadata-view JSON used for every scope instead of the catalog",
    ),
    "FLOW_REQUEST_RETENTION_HOURS": (
        "168",
        "how long a mutating request's `request_id` replays its original response (dedupe "
        "rows older than this are purged)",
    ),
    "FLOW_CRASH_MARKER_FILE": (
        "",
        "fault hook: file the process appends the crash point to (fsync) before it SIGKILLs itself",
    ),
    "FLOW_CRASH_STEP_ENTRY_FILE": (
        "",
        "fault hook: file a runtime worker appends one line to per step entry (crash proofs; "
        "refused in production)",
    ),
    # --- transactional outbox (runtime and effect owner) ---------------------------------
    "FLOW_OUTBOX_DISPATCHERS": (
        "1",
        "runtime and effect owner: run this process's outbox dispatcher and repair sweep (0 = off)",
    ),
    "FLOW_OUTBOX_MAX_ATTEMPTS": (
        "8",
        "outbox: delivery attempts before the budget is exhausted (then acceptance "
        "reconciliation, §15.4)",
    ),
    "FLOW_OUTBOX_RECONCILE_MAX_ATTEMPTS": (
        "10",
        "outbox: `RejectIfUnaccepted` attempts before the handoff is AcceptanceUnknown",
    ),
    "FLOW_OUTBOX_RETRY_BASE_MS": ("500", "outbox: first retry delay (jittered exponential)"),
    "FLOW_OUTBOX_RETRY_MAX_MS": ("60000", "outbox: retry delay cap"),
    "FLOW_OUTBOX_LEASE_MS": (
        "30000",
        "outbox: delivery lease; a delivery call is cut off before it expires",
    ),
    "FLOW_OUTBOX_IDLE_MS": ("500", "outbox: longest idle backoff of the delivery loop"),
    "FLOW_OUTBOX_SWEEP_MS": (
        "1000",
        "outbox: repair-sweep interval (expired leases, pre-finalization candidates)",
    ),
    "FLOW_EFFECT_OWNER_TARGETS": (
        "",
        "runtime: effect owners by kind, `kind=host:port,…` (`*` for any kind); "
        "unset = every kind goes to 127.0.0.1:$FLOW_EFFECT_PORT",
    ),
    # --- effect owner -----------------------------------------------------------------
    "FLOW_EFFECT_RUNTIME_TARGET": (
        "",
        "effect owner: host:port of the runtime that receives completion receipts "
        "(default 127.0.0.1:$FLOW_RUNTIME_PORT)",
    ),
    "FLOW_EFFECT_DISPATCHERS": (
        "1",
        "effect owner: command-dispatcher tasks calling providers in this process (0 = off)",
    ),
    "FLOW_EFFECT_PROVIDERS": (
        "email.smtp=email,webhook.http=webhook",
        "effect owner: owner kinds served and their provider type, email or webhook "
        "(`kind=type,…`)",
    ),
    "FLOW_EFFECT_MAX_ATTEMPTS": ("5", "effect owner: remote attempts per command"),
    "FLOW_EFFECT_RECONCILE_MAX_ATTEMPTS": (
        "10",
        "effect owner: provider lookups of an OUTCOME_UNKNOWN command before quarantine",
    ),
    "FLOW_EFFECT_RETRY_BASE_MS": ("1000", "effect owner: first retry delay (jittered)"),
    "FLOW_EFFECT_RETRY_MAX_MS": ("300000", "effect owner: retry delay cap"),
    "FLOW_EFFECT_LEASE_MS": (
        "60000",
        "effect owner: command lease; provider calls time out well before it",
    ),
    "FLOW_EFFECT_PRECLAIM_COMMAND": (
        "true",
        "effect owner: an acceptance leases its new command to this process's dispatcher "
        "(when it has room) and records the first attempt in the same transaction "
        "(docs/adr/0008); false = wake the dispatcher, which claims it",
    ),
    "FLOW_EFFECT_IDLE_MS": ("500", "effect owner: longest idle backoff of a command dispatcher"),
    "FLOW_EFFECT_RECEIPT_MAX_ATTEMPTS": (
        "1000",
        "effect owner: completion-receipt deliveries before the receipt is dead-lettered",
    ),
    "FLOW_EFFECT_SMTP_HOST": ("127.0.0.1", "effect owner: SMTP server of the email provider"),
    "FLOW_EFFECT_SMTP_PORT": ("1025", "effect owner: SMTP port (`make run` starts a sink here)"),
    "FLOW_EFFECT_SMTP_FROM": ("nexus-flow@localhost", "effect owner: sender address"),
    "FLOW_EFFECT_SMTP_STARTTLS": ("false", "effect owner: upgrade the SMTP session with STARTTLS"),
    "FLOW_EFFECT_SMTP_USERNAME": ("", "effect owner: SMTP AUTH user (empty = no AUTH)"),
    "FLOW_EFFECT_SMTP_PASSWORD_FILE": (
        "",
        "effect owner: file holding the SMTP AUTH password (never logged or stored)",
    ),
    "FLOW_EFFECT_SMTP_TIMEOUT_S": ("10", "effect owner: SMTP connect/command timeout, seconds"),
    "FLOW_EFFECT_WEBHOOK_URL": (
        "",
        "effect owner: endpoint the webhook provider POSTs to (owner configuration, never "
        "Flow metadata; unset = the webhook kind is not served)",
    ),
    "FLOW_EFFECT_WEBHOOK_STATUS_URL": (
        "",
        "effect owner: optional lookup endpoint (GET with `Idempotency-Key`) used to "
        "reconcile OUTCOME_UNKNOWN",
    ),
    "FLOW_EFFECT_WEBHOOK_TIMEOUT_S": ("10", "effect owner: webhook request timeout, seconds"),
    "FLOW_EFFECT_WEBHOOK_IDEMPOTENT": (
        "true",
        "effect owner: the receiver honours `Idempotency-Key`, so an ambiguous attempt may "
        "be replayed with the same key (false = quarantine instead)",
    ),
    "FLOW_MAIL_SINK_DIR": (
        "$FLOW_DATA_DIR/mail",
        "`make run`: directory where the dev mail sink writes one .eml file per message",
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


def _csv(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated list: sorted, distinct, blanks dropped (empty: the default)."""
    values = {v.strip() for v in _get(env, name).split(",") if v.strip()}
    if not values:
        values = {v.strip() for v in ENV_VARS[name][0].split(",") if v.strip()}
    return tuple(sorted(values))


#: The most worker processes one runtime process supervises (a typo such as 400 for 4
#: must not fork hundreds of interpreters).
MAX_WORKER_PROCESSES = 64


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset;
    ``os.cpu_count()`` where affinity is not available)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def worker_processes(raw: str, cores: int) -> int:
    """``FLOW_RUNTIME_WORKER_PROCESSES``: ``auto`` is one process per usable core, an
    integer is taken as is (0 = steps execute in this process).

    Raises:
        ConfigError: neither ``auto`` nor an integer in 0..MAX_WORKER_PROCESSES.
    """
    name = "FLOW_RUNTIME_WORKER_PROCESSES"
    expected = f"{name} must be auto or an integer 0..{MAX_WORKER_PROCESSES}"
    value = raw.strip().lower()
    if value == "auto":
        return min(max(1, cores), MAX_WORKER_PROCESSES)
    try:
        n = int(value)
    except ValueError as exc:
        raise ConfigError(
            f"{name} must be auto or an integer 0..{MAX_WORKER_PROCESSES}, got {raw!r}"
        ) from exc
    if not 0 <= n <= MAX_WORKER_PROCESSES:
        raise ConfigError(f"{expected}, got {n}")
    return n


def _expand(value: str, data_dir: Path) -> str:
    return value.replace("$FLOW_DATA_DIR", str(data_dir))


#: ``FLOW_OTEL_EXPORTER`` values.
OTEL_EXPORTERS = ("otlp", "console", "none")
#: OTLP transports the exporter package ships (``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``).
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True)
class TelemetrySettings:
    """Tracing export and metrics of one process (``FLOW_OTEL_*``, ``FLOW_METRICS_*``).

    Attributes:
        exporter: ``otlp``, ``console`` or ``none``.
        otlp_protocol: the OTLP transport, from the standard
            ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
            (default ``http/protobuf``, the OpenTelemetry specification's default); the
            exporters read endpoint, headers, timeout and TLS from the standard
            variables themselves.
        sql_spans: one span per SQL statement.
        metrics_port: ``/metrics`` port (None: no endpoint; 0: a free port).
        state_interval_ms: period of the authoritative-state scan (0: off).
        state_orgs: orgs one scan pass refreshes.
        count_cap: largest count a state gauge reads per org and state.
        probe_window: runs per org one pass checks for divergence and dual ownership.
        warnings: configuration notes to log once at start-up (deprecated variables).
    """

    exporter: str = "none"
    otlp_protocol: str = "http/protobuf"
    sql_spans: bool = False
    metrics_port: int | None = None
    state_interval_ms: int = 15000
    state_orgs: int = 50
    count_cap: int = 10000
    probe_window: int = 500
    warnings: tuple[str, ...] = ()


def _telemetry(e: Mapping[str, str], enabled: bool) -> TelemetrySettings:
    """``FLOW_OTEL_EXPORTER`` (with the deprecated ``FLOW_OTEL_CONSOLE_EXPORT``), the OTLP
    protocol and the ``FLOW_METRICS_*`` settings.

    Raises:
        ConfigError: an unknown exporter or protocol, a contradiction between the
            exporter variables, or a malformed number.
    """
    explicit = e.get("FLOW_OTEL_EXPORTER", "").strip().lower()
    exporter = explicit or _get(e, "FLOW_OTEL_EXPORTER")
    if exporter not in OTEL_EXPORTERS:
        raise ConfigError(f"FLOW_OTEL_EXPORTER must be one of {OTEL_EXPORTERS}, got {exporter!r}")
    warnings: list[str] = []
    if _bool(e, "FLOW_OTEL_CONSOLE_EXPORT"):
        if explicit and explicit != "console":
            raise ConfigError(
                f"FLOW_OTEL_CONSOLE_EXPORT=true contradicts FLOW_OTEL_EXPORTER={explicit}"
            )
        exporter = "console"
        warnings.append(
            "FLOW_OTEL_CONSOLE_EXPORT is deprecated: set FLOW_OTEL_EXPORTER=console instead"
        )
    if not enabled and explicit in ("otlp", "console"):
        raise ConfigError(
            f"FLOW_OTEL_EXPORTER={explicit} needs tracing: FLOW_OTEL_ENABLED is false"
        )
    protocol = (
        e.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
        or e.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
        or OTLP_PROTOCOLS[0]
    )
    if exporter == "otlp" and protocol not in OTLP_PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {OTLP_PROTOCOLS}, got {protocol!r}"
        )
    raw_port = _get(e, "FLOW_METRICS_PORT").strip()
    port: int | None = None
    if raw_port:
        port = _int(e, "FLOW_METRICS_PORT")
        if port > 65535:
            raise ConfigError(f"FLOW_METRICS_PORT must be <= 65535, got {port}")
    return TelemetrySettings(
        exporter=exporter if enabled else "none",
        otlp_protocol=protocol,
        sql_spans=enabled and _bool(e, "FLOW_OTEL_SQL"),
        metrics_port=port,
        state_interval_ms=_int(e, "FLOW_METRICS_STATE_MS"),
        state_orgs=_int(e, "FLOW_METRICS_STATE_ORGS", minimum=1),
        count_cap=_int(e, "FLOW_METRICS_COUNT_CAP", minimum=1),
        probe_window=_int(e, "FLOW_METRICS_PROBE_WINDOW", minimum=1),
        warnings=tuple(warnings),
    )


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
    #: ``FLOW_EVENT_LOOP`` resolved on this host: ``"uvloop"`` or ``"asyncio"``.
    event_loop: str = field(default="asyncio")
    catalog_target: str = field(default="127.0.0.1:50061")
    client_tls: bool = field(default=False)
    client_tls_ca: Path | None = field(default=None)
    client_tls_cert: Path | None = field(default=None)
    client_tls_key: Path | None = field(default=None)
    client_tls_server_name: str = field(default="")
    auth_service_key: Path = field(default=Path("auth/service_key.pem"))
    auth_service_key_id: str = field(default="service")
    crash_at: str = field(default="")
    #: ``FLOW_REQUEST_RETENTION_HOURS``: the request-dedupe window (every service).
    request_retention_hours: int = 168
    #: ``FLOW_RUNTIME_*``: the runtime's worker/sweep roles and timings (read by
    #: ``runtime_svc.worker.settings.WorkerSettings.from_config``).
    runtime_workers: int = 1
    #: ``FLOW_RUNTIME_WORKER_PROCESSES`` resolved (``auto`` = usable cores; 0 = none).
    runtime_worker_processes: int = 0
    runtime_sweeps: bool = True
    runtime_lease_ms: int = 60_000
    runtime_retry_base_ms: int = 1_000
    runtime_retry_max_ms: int = 300_000
    runtime_max_attempts: int = 5
    runtime_idle_ms: int = 500
    runtime_sweep_ms: int = 1_000
    runtime_reauth_cache_ms: int = 5_000
    #: ``FLOW_RUNTIME_PRECLAIM_WAKE``: the pre-claimed wake (docs/adr/0007).
    runtime_preclaim_wake: bool = True
    runtime_retention_days: int = 30
    runtime_view_file: str | None = None
    runtime_wait_sweep_ms: int = 1_000
    runtime_wait_batch: int = 100
    #: External signal producer kinds ``SubmitWakeSignal`` accepts (sorted, distinct).
    runtime_signal_kinds: tuple[str, ...] = ("external.signal",)
    #: ``FLOW_RUNTIME_LEGACY_SCHEDULER``: run the LegacyInterpreter scheduler here (§20).
    runtime_legacy_scheduler: bool = True
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)

    @property
    def is_production(self) -> bool:
        return self.env == "production"


def event_loop_choice(env: Mapping[str, str] | None = None) -> str:
    """``FLOW_EVENT_LOOP`` resolved on this host (``"uvloop"`` or ``"asyncio"``), for
    processes that are not a service (the bench, its worker processes).

    Raises:
        ConfigError: an unknown value, or ``uvloop`` on a host without it.
    """
    try:
        return loops.resolve(_get(os.environ if env is None else env, "FLOW_EVENT_LOOP"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
    if not db_url.startswith(_DB_URL_PREFIXES):
        *others, last = _DB_URL_PREFIXES
        raise ConfigError(f"{db_var} must be a {', '.join(others)} or {last} URL")

    def _opt_path(name: str) -> Path | None:
        raw = _get(e, name)
        return Path(raw) if raw else None

    tls_cert, tls_key = _opt_path("FLOW_TLS_CERT"), _opt_path("FLOW_TLS_KEY")
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("FLOW_TLS_CERT and FLOW_TLS_KEY must be set together")
    tls_client_ca = _opt_path("FLOW_TLS_CLIENT_CA")
    if tls_client_ca is not None and tls_cert is None:
        raise ConfigError("FLOW_TLS_CLIENT_CA (mTLS) needs FLOW_TLS_CERT and FLOW_TLS_KEY")

    client_ca = _opt_path("FLOW_CLIENT_TLS_CA")
    client_cert, client_key = _opt_path("FLOW_CLIENT_TLS_CERT"), _opt_path("FLOW_CLIENT_TLS_KEY")
    if (client_cert is None) != (client_key is None):
        raise ConfigError("FLOW_CLIENT_TLS_CERT and FLOW_CLIENT_TLS_KEY must be set together")
    client_tls = _bool(e, "FLOW_CLIENT_TLS")
    if client_ca is not None or client_cert is not None:
        if not client_tls and e.get("FLOW_CLIENT_TLS", "").strip():
            raise ConfigError(
                "FLOW_CLIENT_TLS=false contradicts FLOW_CLIENT_TLS_CA/FLOW_CLIENT_TLS_CERT"
            )
        client_tls = True
    retry_base = _int(e, "FLOW_RUNTIME_RETRY_BASE_MS", minimum=1)
    retry_max = max(_int(e, "FLOW_RUNTIME_RETRY_MAX_MS", minimum=1), retry_base)
    if e.get("FLOW_RUNTIME_RETRY_MAX_MS") and retry_max != _int(e, "FLOW_RUNTIME_RETRY_MAX_MS"):
        raise ConfigError("FLOW_RUNTIME_RETRY_MAX_MS must be >= FLOW_RUNTIME_RETRY_BASE_MS")

    otel_enabled = _bool(e, "FLOW_OTEL_ENABLED")
    telemetry = _telemetry(e, otel_enabled)
    loop = event_loop_choice(e)

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
        otel_enabled=otel_enabled,
        otel_console_export=telemetry.exporter == "console",
        log_level=_get(e, "FLOW_LOG_LEVEL").upper(),
        event_loop=loop,
        catalog_target=_get(e, "FLOW_CATALOG_TARGET")
        or f"127.0.0.1:{_int(e, 'FLOW_CATALOG_PORT')}",
        crash_at=_get(e, "FLOW_CRASH_AT"),
        client_tls=client_tls,
        client_tls_ca=client_ca,
        client_tls_cert=client_cert,
        client_tls_key=client_key,
        client_tls_server_name=_get(e, "FLOW_CLIENT_TLS_SERVER_NAME"),
        auth_service_key=Path(
            _expand(_get(e, "FLOW_AUTH_SERVICE_KEY"), data_dir).replace("<service>", service.value)
        ),
        auth_service_key_id=_get(e, "FLOW_AUTH_SERVICE_KEY_ID").replace("<service>", service.value),
        request_retention_hours=_int(e, "FLOW_REQUEST_RETENTION_HOURS", minimum=1),
        runtime_workers=_int(e, "FLOW_RUNTIME_WORKERS"),
        runtime_worker_processes=worker_processes(
            _get(e, "FLOW_RUNTIME_WORKER_PROCESSES"), usable_cores()
        ),
        runtime_sweeps=_bool(e, "FLOW_RUNTIME_SWEEPS"),
        runtime_lease_ms=_int(e, "FLOW_RUNTIME_LEASE_MS", minimum=1),
        runtime_retry_base_ms=retry_base,
        runtime_retry_max_ms=retry_max,
        runtime_max_attempts=_int(e, "FLOW_RUNTIME_MAX_ATTEMPTS", minimum=1),
        runtime_idle_ms=_int(e, "FLOW_RUNTIME_IDLE_MS", minimum=1),
        runtime_sweep_ms=_int(e, "FLOW_RUNTIME_SWEEP_MS", minimum=1),
        runtime_reauth_cache_ms=_int(e, "FLOW_RUNTIME_REAUTH_CACHE_MS"),
        runtime_preclaim_wake=_bool(e, "FLOW_RUNTIME_PRECLAIM_WAKE"),
        runtime_retention_days=_int(e, "FLOW_RUNTIME_RETENTION_DAYS", minimum=1),
        runtime_view_file=_get(e, "FLOW_RUNTIME_VIEW_FILE") or None,
        runtime_wait_sweep_ms=_int(e, "FLOW_RUNTIME_WAIT_SWEEP_MS", minimum=1),
        runtime_wait_batch=_int(e, "FLOW_RUNTIME_WAIT_BATCH", minimum=1),
        runtime_signal_kinds=_csv(e, "FLOW_RUNTIME_SIGNAL_KINDS"),
        runtime_legacy_scheduler=_bool(e, "FLOW_RUNTIME_LEGACY_SCHEDULER"),
        telemetry=telemetry,
    )


# --- outbox and effect owner -----------------------------------------------------------


def parse_kind_map(raw: str, name: str) -> dict[str, str]:
    """Parse ``kind=value,kind=value`` (``*`` allowed as a kind).

    Raises:
        ConfigError: an entry without ``=``, an empty part, or a kind named twice.
    """
    out: dict[str, str] = {}
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        kind, sep, value = entry.partition("=")
        kind, value = kind.strip(), value.strip()
        if not sep or not kind or not value:
            raise ConfigError(f"{name}: entries must be kind=value, got {entry!r}")
        if kind in out:
            raise ConfigError(f"{name}: kind {kind!r} is named twice")
        out[kind] = value
    return out


@dataclass(frozen=True)
class OutboxSettings:
    """``FLOW_OUTBOX_*`` and the runtime's owner routing (``FLOW_EFFECT_OWNER_TARGETS``)."""

    dispatchers: int
    max_attempts: int
    reconcile_max_attempts: int
    retry_base_ms: int
    retry_max_ms: int
    lease_ms: int
    idle_ms: int
    sweep_ms: int
    #: owner kind (or ``*``) -> gRPC target of the effect owner serving it.
    owner_targets: Mapping[str, str]


def load_outbox_settings(env: Mapping[str, str] | None = None) -> OutboxSettings:
    """Read the outbox settings (see :data:`ENV_VARS`).

    Raises:
        ConfigError: a malformed value.
    """
    e: Mapping[str, str] = os.environ if env is None else env
    base = _int(e, "FLOW_OUTBOX_RETRY_BASE_MS", minimum=1)
    targets = parse_kind_map(_get(e, "FLOW_EFFECT_OWNER_TARGETS"), "FLOW_EFFECT_OWNER_TARGETS")
    if not targets:
        targets = {"*": f"127.0.0.1:{_int(e, 'FLOW_EFFECT_PORT')}"}
    return OutboxSettings(
        dispatchers=_int(e, "FLOW_OUTBOX_DISPATCHERS"),
        max_attempts=_int(e, "FLOW_OUTBOX_MAX_ATTEMPTS", minimum=1),
        reconcile_max_attempts=_int(e, "FLOW_OUTBOX_RECONCILE_MAX_ATTEMPTS", minimum=1),
        retry_base_ms=base,
        retry_max_ms=_int(e, "FLOW_OUTBOX_RETRY_MAX_MS", minimum=base),
        lease_ms=_int(e, "FLOW_OUTBOX_LEASE_MS", minimum=100),
        idle_ms=_int(e, "FLOW_OUTBOX_IDLE_MS", minimum=1),
        sweep_ms=_int(e, "FLOW_OUTBOX_SWEEP_MS", minimum=1),
        owner_targets=targets,
    )


@dataclass(frozen=True)
class SmtpSettings:
    """The email provider's SMTP server (owner configuration, never Flow metadata)."""

    host: str
    port: int
    sender: str
    starttls: bool
    username: str
    password_file: Path | None
    timeout_s: float


@dataclass(frozen=True)
class WebhookSettings:
    """The webhook provider's endpoint (owner configuration, never Flow metadata)."""

    url: str
    status_url: str
    timeout_s: float
    idempotent_receiver: bool


@dataclass(frozen=True)
class EffectOwnerSettings:
    """``FLOW_EFFECT_*``: the owner's dispatcher, providers and receipt delivery."""

    runtime_target: str
    dispatchers: int
    #: owner kind -> provider type (``email`` | ``webhook``).
    providers: Mapping[str, str]
    max_attempts: int
    reconcile_max_attempts: int
    retry_base_ms: int
    retry_max_ms: int
    lease_ms: int
    idle_ms: int
    receipt_max_attempts: int
    smtp: SmtpSettings
    webhook: WebhookSettings
    #: ``FLOW_EFFECT_PRECLAIM_COMMAND``: the pre-claimed command (docs/adr/0008).
    preclaim_command: bool = True


_PROVIDER_TYPES = frozenset({"email", "webhook"})


def load_effect_owner_settings(env: Mapping[str, str] | None = None) -> EffectOwnerSettings:
    """Read the effect owner's settings (see :data:`ENV_VARS`).

    Raises:
        ConfigError: a malformed value or an unknown provider type.
    """
    e: Mapping[str, str] = os.environ if env is None else env
    providers = parse_kind_map(_get(e, "FLOW_EFFECT_PROVIDERS"), "FLOW_EFFECT_PROVIDERS")
    bad = sorted(set(providers.values()) - _PROVIDER_TYPES)
    if bad or "*" in providers:
        raise ConfigError(
            f"FLOW_EFFECT_PROVIDERS: provider types must be email or webhook for named kinds,"
            f" got {bad or ['*']}"
        )
    base = _int(e, "FLOW_EFFECT_RETRY_BASE_MS", minimum=1)
    password = _get(e, "FLOW_EFFECT_SMTP_PASSWORD_FILE")
    data_dir = Path(_get(e, "FLOW_DATA_DIR"))
    return EffectOwnerSettings(
        runtime_target=_get(e, "FLOW_EFFECT_RUNTIME_TARGET")
        or f"127.0.0.1:{_int(e, 'FLOW_RUNTIME_PORT')}",
        dispatchers=_int(e, "FLOW_EFFECT_DISPATCHERS"),
        providers=providers,
        max_attempts=_int(e, "FLOW_EFFECT_MAX_ATTEMPTS", minimum=1),
        reconcile_max_attempts=_int(e, "FLOW_EFFECT_RECONCILE_MAX_ATTEMPTS", minimum=1),
        retry_base_ms=base,
        retry_max_ms=_int(e, "FLOW_EFFECT_RETRY_MAX_MS", minimum=base),
        lease_ms=_int(e, "FLOW_EFFECT_LEASE_MS", minimum=1000),
        idle_ms=_int(e, "FLOW_EFFECT_IDLE_MS", minimum=1),
        receipt_max_attempts=_int(e, "FLOW_EFFECT_RECEIPT_MAX_ATTEMPTS", minimum=1),
        smtp=SmtpSettings(
            host=_get(e, "FLOW_EFFECT_SMTP_HOST"),
            port=_int(e, "FLOW_EFFECT_SMTP_PORT", minimum=1),
            sender=_get(e, "FLOW_EFFECT_SMTP_FROM"),
            starttls=_bool(e, "FLOW_EFFECT_SMTP_STARTTLS"),
            username=_get(e, "FLOW_EFFECT_SMTP_USERNAME"),
            password_file=Path(_expand(password, data_dir)) if password else None,
            timeout_s=float(_int(e, "FLOW_EFFECT_SMTP_TIMEOUT_S", minimum=1)),
        ),
        webhook=WebhookSettings(
            url=_get(e, "FLOW_EFFECT_WEBHOOK_URL"),
            status_url=_get(e, "FLOW_EFFECT_WEBHOOK_STATUS_URL"),
            timeout_s=float(_int(e, "FLOW_EFFECT_WEBHOOK_TIMEOUT_S", minimum=1)),
            idempotent_receiver=_bool(e, "FLOW_EFFECT_WEBHOOK_IDEMPOTENT"),
        ),
        preclaim_command=_bool(e, "FLOW_EFFECT_PRECLAIM_COMMAND"),
    )


def mail_sink_dir(env: Mapping[str, str] | None = None) -> Path:
    """``FLOW_MAIL_SINK_DIR`` (the dev stack's mail sink), expanded."""
    e: Mapping[str, str] = os.environ if env is None else env
    data_dir = Path(_get(e, "FLOW_DATA_DIR"))
    return Path(_expand(_get(e, "FLOW_MAIL_SINK_DIR"), data_dir))
