"""The grpcurl cookbook covers every RPC and docs/grpcurl.md is current."""

from __future__ import annotations

from pathlib import Path

from flowctl.cookbook import CALLS, docs_page, documented_calls
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
    assert {e for e, _ in calls} <= {"OK", "UNIMPLEMENTED", "FAILED_PRECONDITION"}
