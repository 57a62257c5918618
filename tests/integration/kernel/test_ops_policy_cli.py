"""``python -m runtime_svc.ops policy show|publish``: an operator publishes the org's
versioned runtime policy (§16.3) — the admission budgets included — from a JSON file;
an invalid document is refused with the offending field and writes nothing; an
unchanged one publishes nothing; the next admission policy read sees a publication."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc import ops
from runtime_svc.admission.controller import AdmissionController
from runtime_svc.definitions.policy_store import PolicyStore


async def test_policy_publish_validates_versions_and_reaches_admission(
    engine: AsyncEngine,
    kernel_db_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"

    async def cli(*argv: str) -> int:
        return await asyncio.to_thread(ops.main, list(argv), db_url=kernel_db_url)

    assert await cli("policy", "show", "--org", org) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 1 and "admission" not in shown["document"]

    document = dict(shown["document"])
    document["admission"] = {
        "flows": {"Invoice_Sync": {"max_inflight": 2, "max_concurrent_runs": 3}}
    }
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(document))
    assert await cli("policy", "publish", "--org", org, "--file", str(path)) == 0
    published = json.loads(capsys.readouterr().out)
    assert published["published"] is True and published["version"] == 2
    assert published["document"]["admission"]["flows"]["Invoice_Sync"]["max_concurrent_runs"] == 3
    # Admission (a fresh process's controller) reads the new generation.
    policy = await AdmissionController(engine, budget=4, quantum=4).policy(org)
    assert policy.flows["Invoice_Sync"].max_concurrent_runs == 3

    # Publishing the same document again writes nothing.
    assert await cli("policy", "publish", "--org", org, "--file", str(path)) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["published"] is False and again["version"] == 2
    assert again["document_digest"] == published["document_digest"]

    # An invalid field: refused with its name, no generation written.
    document["admission"] = {"flows": {"Invoice_Sync": {"max_concurrent_runs": 0}}}
    path.write_text(json.dumps(document))
    assert await cli("policy", "publish", "--org", org, "--file", str(path)) == 1
    err = capsys.readouterr().err
    assert err.startswith("invalid_policy:") and "max_concurrent_runs" in err
    assert (await PolicyStore(engine).current(org)).version == 2


async def test_policy_publish_usage_errors_exit_2_and_write_nothing(
    engine: AsyncEngine,
    kernel_db_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"

    async def cli(*argv: str) -> int:
        return await asyncio.to_thread(ops.main, list(argv), db_url=kernel_db_url)

    missing = tmp_path / "absent.json"
    assert await cli("policy", "publish", "--org", org, "--file", str(missing)) == 2
    assert "cannot read the policy document" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert await cli("policy", "publish", "--org", org, "--file", str(broken)) == 2
    assert "is not JSON" in capsys.readouterr().err
    broken.write_text("[1, 2]")
    assert await cli("policy", "publish", "--org", org, "--file", str(broken)) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    assert await cli("policy", "publish", "--org", org) == 2  # --file is required
    # Nothing was published: the org still has only its seeded default (on first read).
    assert (await PolicyStore(engine).current(org)).version == 1
