"""The grpcurl cookbook covers every RPC and docs/grpcurl.md is current."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowctl.cookbook import (
    CALLS,
    PLACEHOLDER_ENVELOPE,
    _fill,
    docs_page,
    documented_calls,
    placeholder_ids,
)
from flowctl.cookbook_setup import _doc, _envelope, _handoff
from services.auth import TrustedRuntimeWorkScope
from services.proto import catalog_v1, effect_v1, runtime_v1

ROOT = Path(__file__).resolve().parents[3]


def _all_rpcs() -> set[str]:
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.Default()
    names = set()
    for full in (
        "nexus.flow.catalog.v1.CatalogService",
        "nexus.flow.runtime.v1.FlowDefinitionService",
        "nexus.flow.runtime.v1.FlowRunService",
        "nexus.flow.runtime.v1.RecordService",
        "nexus.flow.runtime.v1.WakeSignalService",
        "nexus.flow.effect.v1.EffectOwnerService",
    ):
        service = pool.FindServiceByName(full)
        names |= {f"{full}/{m.name}" for m in service.methods}
    return names


def test_every_rpc_of_the_three_services_has_exactly_one_call() -> None:
    assert catalog_v1 and runtime_v1 and effect_v1  # registers the descriptors
    documented = [f"{c.service}/{c.method}" for c in CALLS]
    assert len(documented) == len(set(documented))
    assert set(documented) == _all_rpcs()


def test_docs_page_is_what_the_generator_writes() -> None:
    committed = (ROOT / "docs" / "grpcurl.md").read_text(encoding="utf-8")
    assert committed == docs_page(), (
        "docs/grpcurl.md is stale: .venv/bin/python -c 'from flowctl.cookbook import "
        'docs_page; open("docs/grpcurl.md", "w").write(docs_page())\''
    )


def test_the_page_parses_into_one_command_per_expectation() -> None:
    calls = documented_calls(docs_page())
    assert len(calls) == len(CALLS) + 6
    assert all(c.startswith("grpcurl ") for _, c in calls)
    assert {e for e, _ in calls} <= {"OK", "FAILED_PRECONDITION"}  # every RPC has landed


def test_the_documented_envelope_is_the_one_the_set_up_hands_over() -> None:
    scope = TrustedRuntimeWorkScope("org-demo", "inst-demo", "cap-flow", "binding-1")
    real = _doc(_envelope(_handoff(scope, "cookbook-n1", 0)))
    shown = render_document(PLACEHOLDER_ENVELOPE, {"nonce": "n1", "binding": "binding-1"})
    assert set(shown) == set(real)
    for field in (
        "message_family",
        "message_family_version",
        "effect_owner_kind",
        "payload_schema_version",
        "payload_digest",
        "payload_json",
        "flow_run_id",
        "step_execution_id",
        "submission_attempt_id",
        "failure_policy",
        "runtime_work_binding_digest",
    ):
        assert shown[field] == real[field], field


def render_document(doc: Mapping[str, Any], values: Mapping[str, str]) -> dict[str, Any]:
    ids = placeholder_ids()
    ids.values.update(values)
    return dict(_fill(dict(doc), ids))
