"""Service replicas as real processes on the cluster: ``python -m runtime_svc`` /
``python -m catalog_svc`` children, each pointed at one node through its own
``FLOW_*_DB_URL`` (the topology of ``docs/scale-out.md``).

All replicas share one data dir for their development keys; the test clients' key ids
(``catalog-test``, ``definitions-test``) are trusted with the same key, so the existing
gRPC test clients work against every replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.auth import ensure_dev_keys, load_signing_key
from tests.integration.catalog.harness import KEY_ID as CATALOG_KEY_ID
from tests.integration.catalog.harness import Client as CatalogClient
from tests.integration.definitions.harness import KEY_ID as DEFINITIONS_KEY_ID
from tests.integration.runs.harness import RunClient
from tests.support.procs import ServiceProcess, free_port, service_env

__all__ = ["Replicas", "running_replicas"]

#: Quiet children: no tracing, warnings only.
_QUIET = {"FLOW_OTEL_ENABLED": "false", "FLOW_LOG_LEVEL": "WARNING"}


class Replicas:
    """Started replicas and clients for them."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        keys = None
        for key_id in ("dev", CATALOG_KEY_ID, DEFINITIONS_KEY_ID):
            keys = ensure_dev_keys(data_dir, env="test", key_id=key_id)
        assert keys is not None
        self.private_key: Ed25519PrivateKey = load_signing_key(keys.signing_key)
        self.catalog: ServiceProcess | None = None
        self.runtimes: list[ServiceProcess] = []

    def start_catalog(self, db_url: str) -> ServiceProcess:
        port = free_port()
        env = service_env(self.data_dir, "catalog", port, db_url=db_url, extra=_QUIET)
        self.catalog = ServiceProcess("catalog", port, env, self.data_dir / "catalog.log")
        self.catalog.start().wait_serving()
        return self.catalog

    def start_runtime(self, db_url: str, extra: Mapping[str, str] | None = None) -> ServiceProcess:
        port = free_port()
        settings = {"FLOW_DB_AUTO_MIGRATE": "false", **_QUIET, **(extra or {})}
        if self.catalog is not None:
            settings.setdefault("FLOW_CATALOG_TARGET", f"127.0.0.1:{self.catalog.port}")
        env = service_env(self.data_dir, "runtime", port, db_url=db_url, extra=settings)
        replica = ServiceProcess(
            "runtime", port, env, self.data_dir / f"runtime{len(self.runtimes)}.log"
        )
        self.runtimes.append(replica)
        replica.start()
        return replica

    def run_client(self, replica: ServiceProcess) -> RunClient:
        return RunClient(grpc.insecure_channel(f"127.0.0.1:{replica.port}"), self.private_key)

    def catalog_client(self) -> CatalogClient:
        assert self.catalog is not None
        return CatalogClient(
            grpc.insecure_channel(f"127.0.0.1:{self.catalog.port}"), self.private_key
        )

    def stop(self) -> None:
        for replica in [*self.runtimes, *([self.catalog] if self.catalog else [])]:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.terminate(timeout=30)


@contextmanager
def running_replicas(data_dir: Path) -> Iterator[Replicas]:
    replicas = Replicas(data_dir)
    try:
        yield replicas
    finally:
        replicas.stop()
