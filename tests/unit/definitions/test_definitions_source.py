"""Flow source validation at registration (the compiler's parse step)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from runtime_svc.definitions import FlowSourceInvalidError, parse_source_json
from runtime_svc.definitions.policy import (
    DEFAULT_POLICY_DOCUMENT,
    default_policy_generation,
    normalize_policy_document,
)
from runtime_svc.definitions.source import SubflowRef, collect_subflows, subflow_refs
from tests.unit.definitions import corpus


def test_a_valid_source_yields_its_parsed_fields() -> None:
    info = parse_source_json(json.dumps(corpus.flow("durable_send_email")))
    assert (info.api_name, info.version, info.process_type) == (
        "durable_send_email",
        1,
        "record_triggered",
    )
    assert info.trigger is not None and info.trigger["object"] == "Contact"
    assert info.action_types == ("send_email",)
    assert info.metadata_digest.startswith("flow-metadata/v1:sha256:")
    reformatted = json.dumps(corpus.flow("durable_send_email"), indent=3, sort_keys=True)
    assert parse_source_json(reformatted).metadata_digest == info.metadata_digest


def test_subflow_references_are_collected() -> None:
    info = parse_source_json(json.dumps(corpus.flow("atomic_subflow_line_items")))
    assert info.subflows == (SubflowRef("recalc_line_items", 1),)
    assert subflow_refs({"elements": [{"type": "Subflow", "flow": 3}, "junk"]}) == ()


def _calls(*targets: str) -> dict[str, Any]:
    return {
        "elements": [{"type": "Subflow", "flow": t, "version": 1} for t in targets],
    }


def test_the_subflow_closure_is_transitive_visits_each_version_once_and_skips_missing_ones() -> (
    None
):
    registry: dict[tuple[str, int], Mapping[str, Any]] = {
        ("a", 1): {"api_name": "a", **_calls("b", "gone")},
        ("b", 1): {"api_name": "b", **_calls("a")},  # a cycle: the compiler reports it
    }
    fetched: list[SubflowRef] = []

    async def fetch(ref: SubflowRef) -> tuple[Mapping[str, Any], str] | None:
        fetched.append(ref)
        doc = registry.get((ref.api_name, ref.version))
        return None if doc is None else (doc, f"fv-{ref.api_name}")

    sources, ids = asyncio.run(collect_subflows(_calls("a"), fetch))
    assert [s["api_name"] for s in sources] == ["a", "b"]
    assert ids == {("a", 1): "fv-a", ("b", 1): "fv-b"}
    assert sorted(fetched) == [SubflowRef("a", 1), SubflowRef("b", 1), SubflowRef("gone", 1)]
    bounded, _ = asyncio.run(collect_subflows(_calls("a"), fetch, limit=1))
    assert [s["api_name"] for s in bounded] == ["a"]


def test_the_default_policy_generation_is_the_normalized_default_document_at_version_one() -> None:
    gen = default_policy_generation("org-1")
    assert (gen.org_id, gen.version) == ("org-1", 1)
    assert gen.same_document(normalize_policy_document(DEFAULT_POLICY_DOCUMENT))
    assert gen.compiler_document()["version"] == 1


def test_bad_json_names_line_and_column() -> None:
    with pytest.raises(FlowSourceInvalidError) as err:
        parse_source_json('{\n "a": }')
    assert err.value.field_path == "source_json:line 2 column 7"
    assert "not valid JSON" in err.value.safe_message
    with pytest.raises(FlowSourceInvalidError) as err:
        parse_source_json("[1, 2]")
    assert err.value.attributes["codes"] == "source.not_object"


def test_every_parse_issue_is_reported_with_its_path() -> None:
    doc = corpus.flow("durable_send_email")
    doc["elements"][0]["nxet"] = "x"
    del doc["start"]
    with pytest.raises(FlowSourceInvalidError) as err:
        parse_source_json(json.dumps(doc))
    paths = {i.path for i in err.value.issues}
    assert "elements[welcome].nxet" in paths and "flow.start" in paths
    assert err.value.attributes["issue_count"] == str(len(err.value.issues))
