"""Fixtures of the fuzz test: the three services (:mod:`.stack`) over fresh databases per
backend (``sqlite``, ``mariadb``), seeded with the ``make run`` demo through the public
APIs, and the values of that tenant the strategies draw from."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pymysql
import pytest
from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct
from sqlalchemy.engine import make_url

from flowctl.demo import DEMO_FLOWS, seed
from services.auth import (
    OPERATOR_ROLES,
    WorkloadClaims,
    bearer_metadata,
    load_signing_key,
    mint_credential,
)
from services.config import ServiceName
from services.proto import common_v1, runtime_v1
from tests.fuzz.stack import FuzzEnv, ServiceStack

#: The message limit the stack serves with (small, so "too large" is reachable).
MAX_MESSAGE_BYTES = 256 * 1024


def _databases(server_url: str, count: int) -> tuple[list[str], list[str]]:
    server = make_url(server_url)
    admin = pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        charset="utf8mb4",
        autocommit=True,
    )
    names = [f"flow_fuzz_{uuid.uuid4().hex[:12]}" for _ in range(count)]
    try:
        with admin.cursor() as cursor:
            for name in names:
                cursor.execute(
                    f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
                )
    finally:
        admin.close()
    urls = [
        server.set(database=n, query={"charset": "utf8mb4"}).render_as_string(hide_password=False)
        for n in names
    ]
    return urls, names


def _drop(server_url: str, names: list[str]) -> None:
    server = make_url(server_url)
    admin = pymysql.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 3306,
        user=server.username or "root",
        password=server.password or "",
        autocommit=True,
    )
    try:
        with admin.cursor() as cursor:
            for name in names:
                cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.close()


_SERVICES = (ServiceName.CATALOG, ServiceName.RUNTIME, ServiceName.EFFECT_OWNER)


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)],
    ids=["sqlite", "mariadb"],
)
def fuzz_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FuzzEnv]:
    data_dir = Path(tmp_path_factory.mktemp("fuzz-data"))
    dropped: list[str] = []
    server_url = ""
    if request.param == "sqlite":
        urls = {s: f"sqlite+aiosqlite:///{data_dir / (s.value + '.db')}" for s in _SERVICES}
    else:
        server_url = request.getfixturevalue("mariadb_server_url")
        created, dropped = _databases(server_url, len(_SERVICES))
        urls = dict(zip(_SERVICES, created, strict=True))
    stack = ServiceStack(urls, data_dir, MAX_MESSAGE_BYTES).start()
    channels = {s: grpc.insecure_channel(stack.target(s)) for s in _SERVICES}
    try:
        yield _seeded(stack, data_dir, channels)
    finally:
        for channel in channels.values():
            channel.close()
        stack.stop()
        if dropped:
            _drop(server_url, dropped)


def _bumped(path: Path) -> str:
    """A demo Flow source as a new version (registering it succeeds once)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["version"] = int(doc.get("version", 1)) + 1
    return json.dumps(doc)


def _seeded(
    stack: ServiceStack, data_dir: Path, channels: dict[ServiceName, grpc.Channel]
) -> FuzzEnv:
    demo = seed(stack.configs, data_dir)
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=demo.org_id,
        app_installation_id=demo.app_installation_id,
        runtime_capability_id=demo.runtime_capability_id,
        runtime_work_binding_digest=demo.binding_digest,
    )
    claims = WorkloadClaims(
        subject="fuzz",
        audiences=_SERVICES,
        org_id=demo.org_id,
        app_installation_id=demo.app_installation_id,
        runtime_capability_id=demo.runtime_capability_id,
        runtime_work_binding_digest=demo.binding_digest,
        roles=OPERATOR_ROLES,
    )
    cfg = stack.configs[ServiceName.RUNTIME]
    token = mint_credential(
        load_signing_key(cfg.auth_signing_key), cfg.auth_signing_key_id, claims, ttl_s=3600
    )
    metadata = bearer_metadata(token)
    fields = Struct()
    fields.update({"LastName": "Fuzz", "Email": "fuzz@example.com"})
    created = runtime_v1.RecordServiceStub(channels[ServiceName.RUNTIME]).CreateRecord(
        runtime_v1.CreateRecordRequest(
            request_id=f"seed-{uuid.uuid4().hex}", object_api_name="Contact", fields=fields
        ),
        metadata=metadata,
        timeout=60,
    )
    plans = [f.plan_id for f in demo.flows]
    known: dict[str, list[Any]] = {
        "org_id": [demo.org_id],
        "app_installation_id": [demo.app_installation_id],
        "runtime_capability_id": [demo.runtime_capability_id],
        "runtime_work_binding_digest": [demo.binding_digest],
        "binding_digest": [demo.binding_digest],
        "catalog_generation_id": [demo.catalog_generation_id],
        "catalog_digest": [demo.catalog_digest],
        "plan_id": plans,
        "plan_digest": [f.plan_digest for f in demo.flows],
        "flow_version_id": [f.flow_version_id for f in demo.flows],
        "flow_api_name": [f.flow_api_name for f in demo.flows],
        "flow_run_id": list(created.triggered_flow_run_ids),
        "record_id": [created.record.record_id],
        "object_api_name": ["Contact", "Account"],
        "action_type": ["crm.send_email", "core.send_email"],
        "holder_id": plans,
        "source_json": [_bumped(path) for path in DEMO_FLOWS],
        "input_json": ['{"name": "x"}', "{}", "[]"],
    }
    special: dict[str, list[Message]] = {
        "nexus.flow.common.v1.TrustedRuntimeWorkScope": [scope],
    }
    return FuzzEnv(stack, metadata, known, special, channels)
