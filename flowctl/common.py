"""Shared plumbing for flowctl commands: configuration, credentials, channels, output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceName, load_config
from services.proto import common_v1

__all__ = [
    "DEMO_SUMMARY_FILE",
    "CliError",
    "UsageError",
    "add_connection_args",
    "call_metadata",
    "channel_for",
    "load_document",
    "print_message",
    "work_scope",
]

#: What ``make run`` writes into the data dir (``flowctl.demo.SUMMARY_FILE``).
DEMO_SUMMARY_FILE = "demo.json"


class CliError(Exception):
    """A user-facing command failure: printed without a traceback, exit code 1."""


class UsageError(CliError):
    """A missing or contradictory flag: printed without a traceback, exit code 2."""


def add_connection_args(parser: argparse.ArgumentParser, service: ServiceName) -> None:
    """``--target``, ``--org`` and optional scope flags used to mint the call credential."""
    cfg = load_config(service)
    parser.add_argument(
        "--target",
        default=f"127.0.0.1:{cfg.port}",
        help=f"host:port of the {service.value} service (default from configuration)",
    )
    parser.add_argument(
        "--org", default=os.environ.get("FLOWCTL_ORG", "org-demo"), help="trusted org"
    )
    parser.add_argument("--app-installation", default=None, help="trusted app installation id")
    parser.add_argument("--capability", default=None, help="trusted runtime capability id")
    parser.add_argument("--binding-digest", default=None, help="trusted RuntimeWorkBindingDigest")


def _demo_scope(org: str) -> dict[str, str] | None:
    """The work scope ``make run`` seeded (``$FLOW_DATA_DIR/demo.json``) when it is ``org``'s."""
    path = load_config(ServiceName.RUNTIME).data_dir / DEMO_SUMMARY_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("org_id") != org:
        return None
    keys = ("app_installation_id", "runtime_capability_id", "binding_digest")
    values = {k: doc.get(k) for k in keys}
    return {k: str(v) for k, v in values.items() if isinstance(v, str) and v} or None


def work_scope(args: argparse.Namespace, command: str) -> common_v1.TrustedRuntimeWorkScope:
    """The complete work scope of a scoped command, filling ``args`` in place.

    Flags win; a flag left out is taken from the demo summary ``make run`` wrote into
    ``$FLOW_DATA_DIR`` when it describes the same org, so the commands work on the demo
    stack without copying digests around.

    Raises:
        UsageError: a part of the scope is still missing (the message names the flags).
    """
    demo = _demo_scope(args.org) or {}
    args.app_installation = args.app_installation or demo.get("app_installation_id")
    args.capability = args.capability or demo.get("runtime_capability_id")
    args.binding_digest = args.binding_digest or demo.get("binding_digest")
    missing = [
        flag
        for flag, value in (
            ("--app-installation", args.app_installation),
            ("--capability", args.capability),
            ("--binding-digest", args.binding_digest),
        )
        if not value
    ]
    if missing:
        raise UsageError(
            f"{command} needs the complete work scope: missing {', '.join(missing)} "
            f"(no {DEMO_SUMMARY_FILE} of org {args.org!r} under FLOW_DATA_DIR to take them from)"
        )
    return common_v1.TrustedRuntimeWorkScope(
        org_id=args.org,
        app_installation_id=args.app_installation,
        runtime_capability_id=args.capability,
        runtime_work_binding_digest=args.binding_digest,
    )


def call_metadata(
    args: argparse.Namespace, service: ServiceName, *, roles: tuple[str, ...] = ()
) -> tuple[tuple[str, str], ...]:
    """Bearer metadata with a short-lived credential minted from the configured signing key.

    Args:
        args: parsed connection flags (org and optional scope).
        service: the audience.
        roles: roles the call needs (for example ``flow.runs.delete``).
    """
    cfg = load_config(service)
    try:
        key = load_signing_key(cfg.auth_signing_key)
    except Exception as exc:
        raise CliError(f"cannot load signing key {cfg.auth_signing_key}: {exc}") from exc
    claims = WorkloadClaims(
        subject="flowctl",
        audiences=(service,),
        org_id=args.org,
        app_installation_id=args.app_installation,
        runtime_capability_id=args.capability,
        runtime_work_binding_digest=args.binding_digest,
        roles=roles,
    )
    token = mint_credential(key, cfg.auth_signing_key_id, claims, ttl_s=300)
    return (("authorization", f"Bearer {token}"),)


@contextmanager
def channel_for(target: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(target) as channel:
        yield channel


def load_document(path: str) -> Any:
    """A JSON or YAML file (``-`` = stdin)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CliError(f"{path}: neither JSON nor YAML: {exc}") from exc


def print_message(message: Message) -> None:
    print(json_format.MessageToJson(message, preserving_proto_field_name=True, indent=2))
