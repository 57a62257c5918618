"""Idempotency key shape: grammar and the rules on top of it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog_svc.domain import (
    CapabilityDescriptor,
    Diagnostic,
    DiagnosticCode,
    KeyShapeError,
    parse_key_shape,
    shape_input_names,
)
from catalog_svc.domain.idempotency_key import KeyShapeSegment
from tests.unit.catalog.factories import effect_descriptor_dict, patch


def test_parse_splits_literals_and_placeholders() -> None:
    assert parse_key_shape("inv:${input.invoice_id}:${step.invocation}") == (
        KeyShapeSegment(literal="inv:"),
        KeyShapeSegment(ref="input.invoice_id"),
        KeyShapeSegment(literal=":"),
        KeyShapeSegment(ref="step.invocation"),
    )
    assert shape_input_names("${input.a}-${input.b}-${run.id}-${input.a}") == {"a", "b"}


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ("", "empty"),
        ("x" * 513, "longer"),
        ("${input.a", "unterminated"),
        ("${flow.id}", "unknown placeholder"),
        ("${input.}", "unknown placeholder"),
        ("${input.1a}", "unknown placeholder"),
        ("a b${run.id}", "' '"),
        ("$${run.id}", "'$'"),
        ("{${run.id}}", "'{'"),
        ("é${run.id}", "'é'"),
    ],
)
def test_grammar_rejections_name_the_offset(shape: str, fragment: str) -> None:
    with pytest.raises(KeyShapeError, match=re.escape(fragment)):
        parse_key_shape(shape)


_literal = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="${}"),
    min_size=1,
)
_ref = st.sampled_from(["run.id", "step.key", "step.invocation"]) | st.from_regex(
    r"\Ainput\.[A-Za-z][A-Za-z0-9_]{0,8}\Z"
)


@given(
    st.lists(
        st.one_of(_literal.map(lambda s: ("l", s)), _ref.map(lambda r: ("r", r))),
        min_size=1,
        max_size=8,
    )
)
def test_every_grammatical_shape_parses_back_to_its_segments(parts: list[tuple[str, str]]) -> None:
    shape = "".join(v if k == "l" else "${" + v + "}" for k, v in parts)
    if len(shape) > 512:
        return
    rebuilt = "".join(
        seg.literal if seg.literal is not None else "${" + (seg.ref or "") + "}"
        for seg in parse_key_shape(shape)
    )
    assert rebuilt == shape


@pytest.mark.parametrize(
    ("shape", "scope", "ok"),
    [
        ("invoice:${input.invoice_id}", "runtime_work_scope", True),
        ("${run.id}/${step.key}", "org", True),
        ("${step.key}:${step.invocation}", "flow_run", True),
        ("${step.key}:${step.invocation}", "runtime_work_scope", False),  # collides across runs
        ("constant-key", "step_invocation", False),  # collapses every invocation
    ],
)
def test_rules_on_top_of_the_grammar(shape: str, scope: str, ok: bool) -> None:
    raw = patch(
        effect_descriptor_dict(),
        {"idempotency_policy.key_shape": shape, "idempotency_policy.uniqueness_scope": scope},
    )
    shape_issues: list[Diagnostic] = []
    desc = CapabilityDescriptor.parse(raw, "", shape_issues)
    assert desc is not None and shape_issues == []
    issues = [(i.path, i.code) for i in desc.validate()]
    if ok:
        assert issues == []
    else:
        assert issues == [("idempotency_policy.key_shape", DiagnosticCode.INVALID_FORMAT)]
