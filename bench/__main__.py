"""``make bench``: kernel figures side by side in one run.

Prints, for the embedded SQLite default and (when ``FLOW_TEST_MYSQL_URL`` is set)
MariaDB:

* raw single-row commits per second (one INSERT per transaction): the ceiling every
  durable step is measured against in later benchmarks;
* fenced compare-and-swap commits per second (one ``cas_update`` per transaction) and
  its ratio to the raw commit rate;
* canonical-digest throughput (pure CPU);
* compile time of a 200-element Flow and small plans compiled per second;
* durable steps committed per second (10-step Flow, one record mutation per step, 1 and 4
  workers) against the raw commit rate, and claim latency with 1,000 vs 100,000 waiting runs
  (``bench/durable_bench.py``);
* durable steps/s with 1 and 2 worker processes (1 and 4 workers each) on one database,
  against the raw commit rate, with the worker CPU per step (``bench/process_bench.py``);
* record mutations per second with no Flow, with one 5-element Embedded Before-Save Flow
  and as Bounded Atomic runs, their ratios and the before-save overhead (target < 15%)
  (``bench/sync_bench.py``);
* on a MySQL-protocol cluster, when ``FLOW_BENCH_CLUSTER_URLS`` lists its nodes: durable
  steps/s with the workers spread over the nodes vs all on one, the certification-conflict
  rate, and cross-node claim latency (``bench/cluster_bench.py``);
* durable-wait wake latency (signal accepted → step Running) p50/p99 with 1,000 and
  100,000 waiting runs and their ratio, the transactions and statements of one wake, and
  the periodic reconciler's cost per sweep as the waiting population grows
  (``bench/wait_bench.py``);
* the external-effect round trip (submit committed → owner accepted → provider called →
  receipt → Flow resumed) p50/p99 with the three services as processes on loopback and a
  local SMTP server, its per-hop cost drivers, and effects/s with 4 runtime workers
  (``bench/effect_bench.py``).
* durable steps/s with tracing and metrics off vs on and the overhead (target ≤ 5 %)
  (``bench/telemetry_bench.py``);
* the cold tenant's p99 queue age under a hot tenant at ten times its load vs alone, with the
  §16 admission controller (target ratio ≤ 2) and without it (``bench/admission_bench.py``).

Nothing here is asserted; figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import (
    admission_bench,
    cluster_bench,
    compile_bench,
    durable_bench,
    effect_bench,
    on_service_loop,
    process_bench,
    sync_bench,
    telemetry_bench,
    wait_bench,
)
from services import db
from services.digest import versioned_digest

_META = sa.MetaData()
_ROWS = sa.Table(
    "bench_rows",
    _META,
    sa.Column("org_id", sa.String(64), primary_key=True),
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("state_version", sa.BigInteger, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
)
_SECONDS = float(os.environ.get("BENCH_SECONDS", "3"))


async def _rate(fn: Callable[[int], Awaitable[None]]) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < _SECONDS:
        await fn(n)
        n += 1
    return n / (time.perf_counter() - start)


async def _bench_db(label: str, url: str) -> None:
    engine: AsyncEngine = db.create_engine(url, pool_size=4)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_META.drop_all)
            await conn.run_sync(_META.create_all)

        async def insert(i: int) -> None:
            async with db.transaction(engine) as conn:
                await conn.execute(
                    _ROWS.insert().values(org_id="org-b", id=f"r{i}", state_version=0, payload="{}")
                )

        async with db.transaction(engine) as conn:
            await conn.execute(
                _ROWS.insert().values(org_id="org-b", id="cas", state_version=0, payload="{}")
            )
        version = 0

        async def cas(i: int) -> None:
            nonlocal version
            async with db.transaction(engine) as conn:
                await db.cas_update(
                    conn,
                    _ROWS,
                    org_id="org-b",
                    key={"id": "cas"},
                    expected_version=version,
                    values={"payload": f'{{"i":{i}}}'},
                )
            version += 1

        raw = await _rate(insert)
        fenced = await _rate(cas)
        print(f"{label:<8} raw single-row commits/s  {raw:10.0f}")
        print(
            f"{label:<8} fenced CAS commits/s      {fenced:10.0f}"
            f"   ratio CAS/raw {fenced / raw:5.2f}"
        )
        async with engine.begin() as conn:
            await conn.run_sync(_META.drop_all)
    finally:
        await engine.dispose()


def _bench_digest() -> None:
    value = {
        "org_id": "org-1",
        "steps": [{"key": f"s{i}", "kind": "PURE_COMPUTE"} for i in range(20)],
    }
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < _SECONDS:
        versioned_digest("plan", value)
        n += 1
    print(f"{'cpu':<8} plan-sized digests/s      {n / (time.perf_counter() - start):10.0f}")


async def _main() -> None:
    print(f"Nexus Flow Runtime kernel bench ({_SECONDS:.0f}s per figure)")
    _bench_digest()
    compile_bench.run(_SECONDS)
    with tempfile.TemporaryDirectory() as tmp:
        await _bench_db("sqlite", f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}")
    mysql = os.environ.get("FLOW_TEST_MYSQL_URL")
    if mysql:
        name = f"bench_{uuid.uuid4().hex[:8]}"
        admin = db.create_engine(mysql.rstrip("/") + "/", pool_size=1)
        async with admin.connect() as conn:
            await conn.execute(sa.text(f"CREATE DATABASE {name}"))
        try:
            await _bench_db("mariadb", f"{mysql.rstrip('/')}/{name}?charset=utf8mb4")
        finally:
            async with admin.connect() as conn:
                await conn.execute(sa.text(f"DROP DATABASE {name}"))
            await admin.dispose()
    else:
        print("mariadb  skipped (set FLOW_TEST_MYSQL_URL=mysql+asyncmy://root:@127.0.0.1:3307)")


if __name__ == "__main__":
    # Every figure runs on the loop the services run on (FLOW_EVENT_LOOP, default auto).
    on_service_loop()
    asyncio.run(_main())
    durable_bench.run(_SECONDS)
    process_bench.run(_SECONDS)
    sync_bench.run(_SECONDS)
    wait_bench.run(_SECONDS)
    effect_bench.run(_SECONDS)
    telemetry_bench.run(_SECONDS)
    admission_bench.run(_SECONDS)
    cluster_bench.run(_SECONDS)
