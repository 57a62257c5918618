"""The operator read path (``python -m <svc> outbox counts|list|show``): org-scoped, one
JSON object per line, never the payload."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from services import db, migrate
from services.db import run_in_transaction
from services.digest import versioned_digest
from services.outbox import NewOutboxMessage, enqueue_txn
from services.outbox.cli import main
from tests.support.dbs import new_org
from tests.support.procs import ROOT

SECRET = "payload-text-that-must-never-be-printed"


def _seed(url: str, org: str) -> None:
    async def go() -> None:
        await migrate.upgrade(url, "effect_owner_svc")
        engine = db.create_engine(url)
        try:
            for i in range(3):
                msg = NewOutboxMessage(
                    org_id=org,
                    app_installation_id="inst-1",
                    runtime_capability_id="cap-1",
                    runtime_work_binding_digest=versioned_digest("b", [org]),
                    message_id=f"m{i}",
                    family="test.family",
                    key=f"k{i}",
                    payload=json.dumps({"secret": SECRET}),
                    payload_digest=versioned_digest("p", i),
                )
                await run_in_transaction(engine, lambda c, m=msg: enqueue_txn(c, OWNER_OUTBOX, m))
        finally:
            await engine.dispose()

    asyncio.run(go())


def test_counts_list_and_show_are_org_scoped_and_payload_free(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Path(sqlite_url.split("///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    org, other = new_org(), new_org()
    _seed(sqlite_url, org)
    assert main(["counts", "--org", org], "effect_owner_svc", OWNER_OUTBOX, sqlite_url) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"Pending": 3}
    assert (
        main(["list", "--org", org, "--after", "m0"], "effect_owner_svc", OWNER_OUTBOX, sqlite_url)
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["message_id"] for x in lines] == ["m1", "m2"]
    assert (
        main(["show", "--org", org, "--id", "m2"], "effect_owner_svc", OWNER_OUTBOX, sqlite_url)
        == 0
    )
    shown = capsys.readouterr().out
    assert json.loads(shown)["key"] == "k2" and SECRET not in shown
    assert (
        main(["show", "--org", other, "--id", "m2"], "effect_owner_svc", OWNER_OUTBOX, sqlite_url)
        == 1
    )
    assert (
        main(
            ["list", "--org", other, "--state", "Pending"],
            "effect_owner_svc",
            OWNER_OUTBOX,
            sqlite_url,
        )
        == 0
    )
    assert capsys.readouterr().out == ""
    assert main(["list"], "effect_owner_svc", OWNER_OUTBOX, sqlite_url) == 2  # --org required


def test_the_service_command_line_serves_it(sqlite_url: str, tmp_path: Path) -> None:
    Path(sqlite_url.split("///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    org = new_org()
    _seed(sqlite_url, org)
    env = {
        "FLOW_DATA_DIR": str(tmp_path),
        "FLOW_EFFECT_DB_URL": sqlite_url,
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "effect_owner_svc", "outbox", "counts", "--org", org],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"] == {"Pending": 3}
