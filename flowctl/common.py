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

__all__ = [
    "CliError",
    "add_connection_args",
    "call_metadata",
    "channel_for",
    "load_document",
    "print_message",
]


class CliError(Exception):
    """A user-facing command failure: printed without a traceback, exit code 1."""


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


def call_metadata(args: argparse.Namespace, service: ServiceName) -> tuple[tuple[str, str], ...]:
    """Bearer metadata with a short-lived credential minted from the configured signing key."""
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
