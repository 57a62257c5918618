"""The Flow language: its documentation and JSON Schema stay in step with the parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime_svc.compiler import FlowDef
from runtime_svc.compiler.diagnostics import IssueSink
from runtime_svc.compiler.language import ElementType, parse_duration
from runtime_svc.compiler.parse import TOP_LEVEL_KEYS, parse_flow
from runtime_svc.compiler.parse_elements import ELEMENT_KEYS
from runtime_svc.compiler.source_reader import IGNORED_KEYS
from tests.unit.compiler.compiler_corpus import FLOWS, INPUTS, flow_names, read_json

DOCS = Path(__file__).resolve().parents[3] / "docs"
SCHEMA = read_json(DOCS / "flow-language.schema.json")
GUIDE = (DOCS / "flow-language.md").read_text(encoding="utf-8")
_COMMON = {"api_name", "type"} | IGNORED_KEYS


def test_schema_top_level_matches_the_parser() -> None:
    assert set(SCHEMA["properties"]) == set(TOP_LEVEL_KEYS) | IGNORED_KEYS


@pytest.mark.parametrize("etype", list(ElementType))
def test_schema_element_matches_the_parser(etype: ElementType) -> None:
    props = set(SCHEMA["$defs"][etype.value]["properties"])
    assert props - _COMMON == set(ELEMENT_KEYS[etype])
    assert SCHEMA["$defs"][etype.value]["properties"]["type"] == {"const": etype.value}
    assert f"`{etype.value}`" in GUIDE


def test_guide_documents_every_code_the_corpus_emits() -> None:
    codes: set[str] = set()
    for name in flow_names():
        diag = FLOWS / name / "diagnostics.json"
        if diag.exists():
            codes |= {i["code"] for i in read_json(diag)["issues"]}
        else:
            codes |= {d["code"] for d in read_json(FLOWS / name / "plan.json")["diagnostics"]}
    for code in sorted(codes):
        family, _, kind = code.rpartition(".")
        if family in ("atomic_unsafe", "before_save_ineligible", "profile.not_atomic"):
            assert f"`{family}.<kind>`" in GUIDE and f"`{kind}`" in GUIDE, code
        else:
            assert f"`{code}`" in GUIDE, code


def test_corpus_validates_against_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(SCHEMA)
    docs = [FLOWS / n / "flow.json" for n in flow_names()] + sorted(
        (INPUTS / "subflows").glob("*.json")
    )
    for path in docs:
        errors = list(validator.iter_errors(read_json(path)))
        if path.parent.name == "reject_malformed_source":
            assert errors
        else:
            assert not errors, (path, errors[0].message)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("PT4H", 14400),
        ("P1D", 86400),
        ("P2W", 1209600),
        ("P1DT30M", 88200),
        ("PT90S", 90),
        ("P1M", None),
        ("P1Y", None),
        ("P", None),
        ("PT", None),
        ("P1DT", None),
        ("4H", None),
    ],
)
def test_durations(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds


def test_parse_normalizes_order_and_ignores_non_semantic_fields() -> None:
    doc = read_json(FLOWS / "embedded_discount_transform" / "flow.json")
    sink = IssueSink()
    flow = parse_flow(doc, sink)
    assert isinstance(flow, FlowDef) and not sink.has_errors
    assert [e.api_name for e in flow.elements] == sorted(e["api_name"] for e in doc["elements"])
    reordered = {**doc, "elements": list(reversed(doc["elements"])), "description": "other words"}
    again = parse_flow(reordered, IssueSink())
    assert again is not None and again.metadata_digest() == flow.metadata_digest()
    assert "other words" not in json.dumps(again.to_dict())
    assert "Size?" not in json.dumps(flow.to_dict())  # an element label
