"""The one command-line entry point shared by the three services.

``python -m <service> [serve]`` starts the gRPC server (migrating the database
first when ``FLOW_DB_AUTO_MIGRATE`` is true) and the service's background loops;
``python -m <service> db upgrade|verify|current`` manages the schema;
``python -m <service> outbox counts|list|show`` reads the service's outbox (when it has
one; ``services.outbox.cli``). Each service's ``__main__`` only names itself and
supplies factories for its servicers and (optionally) its background loops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from services import db, faults, migrate
from services.config import ConfigError, ServiceConfig, ServiceName, load_config
from services.grpc_server import ServiceRegistration, serve_forever
from services.logging import configure_logging
from services.outbox.store import OutboxTable

__all__ = ["Background", "BackgroundFactory", "RegistrationFactory", "run_service"]

#: Builds the servicers of one service from its configuration and database engine.
RegistrationFactory = Callable[
    [ServiceConfig, AsyncEngine], Awaitable[Sequence[ServiceRegistration]]
]


class Background(Protocol):
    """Background loops of a process (workers, sweeps, dispatchers)."""

    async def stop(self) -> None:
        """Stop every loop (idempotent); awaited before the database engine is disposed."""


#: Starts a service's background loops once its servicers exist.
BackgroundFactory = Callable[[ServiceConfig, AsyncEngine], Awaitable[Background]]

log = logging.getLogger(__name__)


async def _serve(
    cfg: ServiceConfig,
    migrations_pkg: str,
    factory: RegistrationFactory,
    background: BackgroundFactory | None,
) -> None:
    if cfg.db_auto_migrate:
        await migrate.upgrade(cfg.db_url, migrations_pkg)
    engine = db.create_engine(cfg.db_url, pool_size=cfg.db_pool_size)
    loops: Background | None = None
    try:
        registrations = await factory(cfg, engine)
        if background is not None:
            loops = await background(cfg, engine)
        await serve_forever(cfg, registrations)
    finally:
        if loops is not None:
            await loops.stop()
        await engine.dispose()


def run_service(
    service: ServiceName,
    migrations_pkg: str,
    factory: RegistrationFactory,
    argv: Sequence[str] | None = None,
    *,
    background: BackgroundFactory | None = None,
    outbox: OutboxTable | None = None,
) -> int:
    """Parse ``argv`` and serve or manage the schema of ``service``; returns the exit code."""
    parser = argparse.ArgumentParser(prog=f"python -m {migrations_pkg}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve gRPC (default)")
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
    try:
        asyncio.run(_serve(cfg, migrations_pkg, factory, background))
    except KeyboardInterrupt:
        return 0
    return 0
