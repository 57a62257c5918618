"""``flowctl`` entry point: ``flowctl <group> <command> …``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import grpc

from flowctl.common import CliError, UsageError
from services.config import ConfigError

__all__ = ["build_parser", "main"]

#: Command groups: each module exposes ``register(subparsers)``; a group whose module is
#: not present yet is simply not offered.
GROUPS = (
    "flowctl.auth",
    "flowctl.catalog",
    "flowctl.flow",
    "flowctl.runs",
    "flowctl.records",
    "flowctl.signal",
    "flowctl.deploy",
)


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


def _rpc_error_text(exc: grpc.RpcError, target: str | None) -> str:
    """One line: the status and what it means for the operator."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    details = " ".join(str(details).split())  # never more than one line
    if code is grpc.StatusCode.UNAVAILABLE and target:
        cause = details.rsplit(": ", 1)[-1] if "connect" in details.lower() else details
        return (
            f"cannot reach {target}: {cause} (is the stack running? `make run`, or set "
            "--target / the FLOW_*_PORT variable)"
        )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and target:
        return f"{target} did not answer in time: {details}"
    return f"{code.name if code else 'ERROR'}: {details}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ConfigError as exc:
        print(f"flowctl: configuration: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"flowctl: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"flowctl: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"flowctl: configuration: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"flowctl: {_rpc_error_text(exc, getattr(args, 'target', None))}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"flowctl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
