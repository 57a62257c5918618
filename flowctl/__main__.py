"""``flowctl`` entry point: ``flowctl <group> <command> …``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import grpc

from flowctl.common import CliError
from services.config import ConfigError

__all__ = ["build_parser", "main"]

#: Command groups: each module exposes ``register(subparsers)``; a group whose module is
#: not present yet is simply not offered.
GROUPS = ("flowctl.auth", "flowctl.catalog", "flowctl.flow", "flowctl.deploy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowctl", description="Nexus Flow Runtime operator CLI")
    groups = parser.add_subparsers(dest="group", required=True)
    for name in GROUPS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"flowctl: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"flowctl: configuration: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"flowctl: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
