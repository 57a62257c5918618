"""The one command-line entry point shared by the three services.

``python -m <service> [serve]`` starts the gRPC server (migrating the database
first when ``FLOW_DB_AUTO_MIGRATE`` is true) and the service's background loops;
``python -m <service> worker`` (services with background loops) runs only those loops,
with a gRPC server that answers health and reflection and serves no RPC, so worker-only
replicas scale apart from the API replicas and still have probes; ``worker --supervised``
is how a supervisor (``services.process_pool``) starts one: end-of-file on stdin (the
supervisor stopped or died) drains the process exactly as SIGTERM does, and message lines
on stdin (``services.supervisor_link``) reach the background duties as hints;
``python -m <service> db upgrade|verify|current`` manages the schema;
``python -m <service> outbox counts|list|show`` reads the service's outbox (when it has
one; ``services.outbox.cli``). Each
service's ``__main__`` only names itself and supplies factories for its
servicers and (optionally) its background loops.

Every process (``serve`` and ``worker`` alike) sets up tracing
(``services.telemetry``), serves ``/metrics`` on ``FLOW_METRICS_PORT`` when it is set
and, with ``FLOW_METRICS_STATE_MS`` > 0, runs the bounded authoritative-state scan of the
service's state sources (``services.metrics_state``).

Before migrating or serving, the database server's settings are checked
(:func:`services.db_profiles.verify_database`, and on a Galera node
:func:`services.db_cluster.check_cluster`): a MySQL-protocol server whose settings
would break the fencing assumptions makes the process exit 3 with a message naming the
setting.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from services import db, db_cluster, db_profiles, event_loop, faults, migrate
from services.background import LoopGroup
from services.config import ConfigError, ServiceConfig, ServiceName, load_config
from services.grpc_server import RunningServer, ServiceRegistration, serve_forever
from services.health_watch import HealthSource, HealthWatch, start_health_watch
from services.logging import configure_logging
from services.metrics import MetricsServer, start_metrics_server
from services.metrics_state import OutboxStateSource, StateScan, StateSource
from services.outbox.store import OutboxTable
from services.supervisor_link import LineDecoder, SupervisorMessages
from services.telemetry import configure_tracing, instrument_engine, shutdown_tracing

__all__ = [
    "Background",
    "BackgroundFactory",
    "Observability",
    "RegistrationFactory",
    "StateSourceFactory",
    "run_service",
    "start_observability",
]

#: Builds the servicers of one service from its configuration and database engine.
RegistrationFactory = Callable[
    [ServiceConfig, AsyncEngine], Awaitable[Sequence[ServiceRegistration]]
]


class Background(Protocol):
    """Background loops of a process (workers, sweeps, dispatchers). One that can fail
    without the server noticing (e.g. crash-looping worker processes) also implements
    :class:`services.health_watch.HealthSource`; its reason then turns the process's gRPC
    health NOT_SERVING."""

    async def stop(self) -> None:
        """Stop every loop (idempotent); awaited before the database engine is disposed."""


#: Starts a service's background loops once its servicers exist.
BackgroundFactory = Callable[[ServiceConfig, AsyncEngine], Awaitable[Background]]

#: Builds a service's state sources from its configuration.
StateSourceFactory = Callable[[ServiceConfig], Sequence[StateSource]]

log = logging.getLogger(__name__)


class Observability:
    """The process's ``/metrics`` endpoint and state scan (stopped together)."""

    def __init__(self, server: MetricsServer | None, loops: LoopGroup | None) -> None:
        self.server, self._loops = server, loops

    async def stop(self) -> None:
        """Stop the scan, then the endpoint (idempotent)."""
        loops, self._loops = self._loops, None
        if loops is not None:
            await loops.stop()
        server, self.server = self.server, None
        if server is not None:
            server.stop()


async def start_observability(
    cfg: ServiceConfig, engine: AsyncEngine, sources: Sequence[StateSource]
) -> Observability:
    """Serve ``/metrics`` on ``FLOW_METRICS_PORT`` (when set) and run the bounded state
    scan every ``FLOW_METRICS_STATE_MS`` (when > 0 and the service has sources).

    Raises:
        ConfigError: the metrics port cannot be bound.
    """
    settings = cfg.telemetry
    if settings.metrics_port is None:
        return Observability(None, None)
    try:
        server = start_metrics_server(cfg.listen_host, settings.metrics_port)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {cfg.listen_host}:{settings.metrics_port} "
            f"(FLOW_METRICS_PORT): {exc}"
        ) from exc
    loops = None
    if sources and settings.state_interval_ms > 0:
        scan = StateScan(
            engine,
            sources,
            orgs_per_pass=settings.state_orgs,
            interval_s=settings.state_interval_ms / 1000,
        )
        loops = LoopGroup([scan.loop()]).start()
    return Observability(server, loops)


_PORT_VARS = {
    ServiceName.CATALOG: "FLOW_CATALOG_PORT",
    ServiceName.RUNTIME: "FLOW_RUNTIME_PORT",
    ServiceName.EFFECT_OWNER: "FLOW_EFFECT_PORT",
}


async def _no_servicers(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The registrations of a worker-only process: none (health and reflection only)."""
    del cfg, engine
    return ()


def _read_supervisor(receiver: SupervisorMessages | None) -> None:
    """Supervised child: read the supervisor's pipe on stdin. Each message line
    (``services.supervisor_link``) goes to ``receiver``; end-of-file (the supervisor
    closed the pipe or died) signals this process SIGTERM so it drains through the one
    shutdown path."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    decoder = LineDecoder()

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            log.info("supervisor gone (stdin closed); draining")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        for message in decoder.feed(data):
            if receiver is None:
                continue
            try:
                receiver.on_supervisor_message(message)
            except Exception:  # a hint must never take the child down
                log.exception("a supervisor message could not be handled")

    loop.add_reader(fd, readable)


async def _serve(
    cfg: ServiceConfig,
    migrations_pkg: str,
    factory: RegistrationFactory,
    background: BackgroundFactory | None,
    state_sources: Sequence[StateSource] = (),
    *,
    supervised: bool = False,
) -> None:
    configure_tracing(cfg)
    running = type(asyncio.get_running_loop()).__module__.split(".")[0]
    log.info("event loop: %s (FLOW_EVENT_LOOP)", running)
    engine = db.create_engine(cfg.db_url, pool_size=cfg.db_pool_size)
    instrument_engine(engine, cfg)
    loops: Background | None = None
    watch: HealthWatch | None = None
    observed = Observability(None, None)
    try:
        settings = await db_profiles.verify_database(engine)
        if settings is not None:
            log.info("database server %s passed the settings check", settings.version)
        # On a Galera node also the cluster profile's rules (services.db_cluster).
        await db_cluster.check_cluster(engine)
        if cfg.db_auto_migrate:
            await migrate.upgrade(cfg.db_url, migrations_pkg)
        observed = await start_observability(cfg, engine, state_sources)
        registrations = await factory(cfg, engine)
        if background is not None:
            loops = await background(cfg, engine)
        source = loops if isinstance(loops, HealthSource) else None

        def on_started(running: RunningServer) -> None:
            nonlocal watch
            # Start-up is done (imports, engine, servicers, loops): move what it allocated
            # out of the collector's reach. A full collection otherwise rescans those
            # ~150k long-lived objects every time — a 100-250 ms pause on the event loop
            # that serves the wake path on a loaded host (docs/performance.md, round 5).
            gc.collect()
            gc.freeze()
            if supervised:
                _read_supervisor(loops if isinstance(loops, SupervisorMessages) else None)
            if source is not None:
                watch = start_health_watch(running, source)

        await serve_forever(cfg, registrations, on_started=on_started)
    finally:
        if watch is not None:
            await watch.stop()
        if loops is not None:
            await loops.stop()
        await observed.stop()
        await engine.dispose()
        shutdown_tracing()


def run_service(
    service: ServiceName,
    migrations_pkg: str,
    factory: RegistrationFactory,
    argv: Sequence[str] | None = None,
    *,
    background: BackgroundFactory | None = None,
    outbox: OutboxTable | None = None,
    state_sources: StateSourceFactory | None = None,
) -> int:
    """Parse ``argv`` and serve or manage the schema of ``service``; returns the exit code.

    ``state_sources`` builds the service's authoritative-state gauges
    (``services.metrics_state``); the outbox's backlog gauges are added when ``outbox``
    is given.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {migrations_pkg}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve gRPC (default)")
    if background is not None:
        worker = sub.add_parser(
            "worker", help="run only the background loops (gRPC health and reflection only)"
        )
        worker.add_argument(
            "--supervised",
            action="store_true",
            help="started by a supervisor: end-of-file on stdin drains the process like SIGTERM",
        )
    db_parser = sub.add_parser("db", help="schema management")
    db_parser.add_argument(
        "db_args", nargs=argparse.REMAINDER, help="upgrade [--revision R] | verify | current"
    )
    if outbox is not None:
        outbox_parser = sub.add_parser("outbox", help="operator reads of the outbox")
        outbox_parser.add_argument(
            "outbox_args", nargs=argparse.REMAINDER, help="counts | list | show (--org ORG)"
        )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    try:
        cfg = load_config(service)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level)

    if args.command == "db":
        return migrate.main(list(args.db_args), migrations_pkg, cfg.db_url)
    if args.command == "outbox" and outbox is not None:
        from services.outbox import cli

        return cli.main(list(args.outbox_args), migrations_pkg, outbox, cfg.db_url)

    try:
        faults.assert_hooks_allowed(cfg.env)
    except faults.FaultHookError as exc:
        log.error("refusing to start: %s", exc)
        return 3
    if args.command == "worker":
        factory = _no_servicers
    sources = list(state_sources(cfg) if state_sources is not None else ())
    if outbox is not None:
        name = "owner" if service is ServiceName.EFFECT_OWNER else service.value
        sources.append(OutboxStateSource(outbox, name, count_cap=cfg.telemetry.count_cap))
    try:
        supervised = bool(getattr(args, "supervised", False))
        event_loop.run(
            _serve(cfg, migrations_pkg, factory, background, sources, supervised=supervised),
            cfg.event_loop,
        )
    except KeyboardInterrupt:
        return 0
    except ConfigError as exc:  # e.g. key or TLS material a factory could not read
        log.error("configuration error: %s", exc)
        return 2
    except (db_profiles.UnsafeDatabaseSettingsError, db_cluster.ClusterSettingsError) as exc:
        log.error("refusing to start: %s", exc)
        return 3
    except RuntimeError as exc:
        if "bind" not in str(exc).lower():
            raise
        # grpc's own message only says "Failed to bind"; name the setting to change.
        log.error(
            "refusing to start: cannot listen on %s:%d (%s): the port is in use by another "
            "process or the address is not on this host",
            cfg.listen_host,
            cfg.port,
            _PORT_VARS[service],
        )
        return 3
    return 0
