"""Property tests for plan identity (§7.3, §22.1).

* Non-semantic changes - whitespace and redundant parentheses in expressions,
  JSON key order, element/variable/filter/event order, JSON vs YAML text,
  labels and builder coordinates - leave the whole plan (step keys, digests,
  diagnostics) unchanged.
* Every input the plan identity names - a referenced capability, the handler
  binding fingerprint, the catalog generation, the metadata view, the trigger
  set, a subflow's plan, the compiler version, the policy version - changes
  the plan digest.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable
from functools import cache
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_svc.compiler import CompilerInputs, ExecutionPlan, PlanCompileError, compile_plan
from tests.unit.compiler.compiler_corpus import (
    FLOWS,
    flow_names,
    inputs_doc,
    load_inputs,
    read_flow,
)

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_EXPR_MAP_KEYS = ("fields", "inputs")


@cache
def _inputs() -> CompilerInputs:
    return load_inputs()


def _source(name: str) -> dict[str, Any]:
    return read_flow(name)


SUCCESS = [
    n
    for n in flow_names()
    if (FLOWS / n / "plan.json").exists() and not (FLOWS / n / "inputs_patch.json").exists()
]
REJECTED = [
    n
    for n in flow_names()
    if (FLOWS / n / "diagnostics.json").exists()
    and not (FLOWS / n / "inputs_patch.json").exists()
    and n != "reject_malformed_source"  # reports list indexes for unnamed elements by design
]


def _ws(rnd: random.Random) -> str:
    return rnd.choice(["", " ", "  ", "\n", "\t "])


def _wrap(expr: Any, rnd: random.Random) -> Any:
    if not isinstance(expr, str) or rnd.random() < 0.3:
        return expr
    return f"{_ws(rnd)}({_ws(rnd)}{expr}{_ws(rnd)}){_ws(rnd)}"


def _shuffle_keys(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffle_keys(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [_shuffle_keys(v, rnd) for v in value]
    return value


def reformat(doc: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """A semantically identical variant of a Flow document."""
    d = copy.deepcopy(doc)
    rnd.shuffle(d["elements"])
    rnd.shuffle(d.setdefault("variables", []))
    trig = d.get("trigger")
    if isinstance(trig, dict):
        rnd.shuffle(trig["events"])
        if "entry_condition" in trig:
            trig["entry_condition"] = _wrap(trig["entry_condition"], rnd)
    for el in d["elements"]:
        if not isinstance(el, dict):
            continue
        if rnd.random() < 0.5:
            el["label"] = f"Label {rnd.randint(0, 99)}"
            el["location"] = {"x": rnd.randint(0, 900), "y": rnd.randint(0, 900)}
        for a in el.get("assignments", []):
            a["value"] = _wrap(a["value"], rnd)
        for r in el.get("rules", []):
            r["condition"] = _wrap(r["condition"], rnd)
        if "filters" in el:
            rnd.shuffle(el["filters"])
            for f in el["filters"]:
                f["value"] = _wrap(f["value"], rnd)
        for key in _EXPR_MAP_KEYS:
            for k in list(el.get(key, {})):
                el[key][k] = _wrap(el[key][k], rnd)
        w = el.get("wait")
        if isinstance(w, dict):
            for k in ("until", "key", "condition"):
                if k in w:
                    w[k] = _wrap(w[k], rnd)
    shuffled: dict[str, Any] = _shuffle_keys(d, rnd)
    return shuffled


def _encode(doc: dict[str, Any], fmt: str, rnd: random.Random) -> dict[str, Any] | str:
    if fmt == "json":
        return json.dumps(doc, indent=rnd.choice([None, 1, 4]), ensure_ascii=rnd.random() < 0.5)
    if fmt == "yaml":
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    return doc


@PROPS
@given(
    name=st.sampled_from(SUCCESS),
    seed=st.integers(0, 2**32 - 1),
    fmt=st.sampled_from(["dict", "json", "yaml"]),
)
def test_non_semantic_changes_leave_the_plan_unchanged(name: str, seed: int, fmt: str) -> None:
    rnd = random.Random(seed)
    base = compile_plan(_source(name), _inputs())
    variant = compile_plan(_encode(reformat(_source(name), rnd), fmt, rnd), _inputs())
    assert variant.step_keys == base.step_keys
    assert variant.plan_digest == base.plan_digest
    assert variant.flow.metadata_digest == base.flow.metadata_digest
    assert variant.to_dict() == base.to_dict()


@PROPS
@given(name=st.sampled_from(REJECTED), seed=st.integers(0, 2**32 - 1))
def test_non_semantic_changes_leave_diagnostics_unchanged(name: str, seed: int) -> None:
    def issues(doc: dict[str, Any]) -> list[tuple[str, str, str, tuple[str, ...]]]:
        try:
            compile_plan(doc, _inputs())
        except PlanCompileError as exc:
            # Offsets point into the author's text, so they move with its whitespace.
            return [
                (i.path, i.code, re.sub(r"offset \d+", "offset N", i.message), i.blocker_chain)
                for i in exc.issues
            ]
        raise AssertionError(f"{name} compiled")

    assert issues(reformat(_source(name), random.Random(seed))) == issues(_source(name))


# ------------------------------------------------------------------ sensitivity

_Mutation = Callable[[dict[str, Any], st.DataObject], None]


def _entry(doc: dict[str, Any], action_type: str) -> dict[str, Any]:
    return next(e for e in doc["catalog"]["entries"] if e["action_type"] == action_type)


def _cap(field: str, strategy: st.SearchStrategy[Any]) -> _Mutation:
    def mutate(doc: dict[str, Any], data: st.DataObject) -> None:
        caps = _entry(doc, "send_email")["capabilities"]
        path = field.split(".")
        target = caps
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = data.draw(strategy.filter(lambda v: v != target.get(path[-1])))

    return mutate


def _digest(kind: str) -> st.SearchStrategy[str]:
    return st.text("0123456789abcdef", min_size=64, max_size=64).map(
        lambda h: f"{kind}/v1:sha256:{h}"
    )


def _set(path: str, strategy: st.SearchStrategy[Any]) -> _Mutation:
    def mutate(doc: dict[str, Any], data: st.DataObject) -> None:
        keys = path.split(".")
        target = doc
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = data.draw(strategy.filter(lambda v: v != target[keys[-1]]))

    return mutate


def _fingerprint(doc: dict[str, Any], data: st.DataObject) -> None:
    # A handler implementation change changes the handler version and so the fingerprint (§8.1).
    e = _entry(doc, "send_email")
    e["handler_version"] = data.draw(st.sampled_from(["2.1.1", "3.0.0"]))
    e["binding_fingerprint"] = data.draw(
        _digest("binding-fingerprint").filter(lambda v: v != e["binding_fingerprint"])
    )


def _entry_digest(doc: dict[str, Any], data: st.DataObject) -> None:
    e = _entry(doc, "send_email")
    e["entry_digest"] = data.draw(_digest("catalog-entry").filter(lambda v: v != e["entry_digest"]))


def _view(doc: dict[str, Any], data: st.DataObject) -> None:
    new = data.draw(_digest("metadata-view").filter(lambda v: v != doc["metadata_view"]["digest"]))
    doc["metadata_view"]["digest"] = new
    doc["binding"]["metadata_view_digest"] = new


def _trigger_set(doc: dict[str, Any], data: st.DataObject) -> None:
    sub = next(
        s
        for s in doc["metadata_view"]["trigger_subscriptions"]
        if s["flow_api_name"] == "durable_send_email"
    )
    sub["dispatch_order"] = data.draw(
        st.integers(0, 1000).filter(lambda v: v != sub["dispatch_order"])
    )


MUTATIONS: dict[str, _Mutation] = {
    "capability.replay_policy": _cap(
        "replay_policy", st.sampled_from(["deterministic_replay", "at_most_once", "not_replayable"])
    ),
    "capability.output_durability": _cap(
        "output_durability", st.sampled_from(["ephemeral", "checkpointed"])
    ),
    "capability.fanout_max": _cap("fanout_bound.max", st.integers(2, 50)),
    "capability.idempotency": _cap("idempotency.key_shape", st.text(min_size=1, max_size=12)),
    # (``system`` would need a declared system identity in the Flow: a compile error, §17.)
    "capability.security": _cap(
        "security.principal_mode", st.sampled_from(["initiating_principal", "run_as_user"])
    ),
    "capability.owner_id": _cap("effect_owner.owner_id", st.text(min_size=1, max_size=12)),
    "handler.binding_fingerprint": _fingerprint,
    "entry.entry_digest": _entry_digest,
    "catalog.generation_id": _set(
        "catalog.generation.generation_id", st.text(min_size=1, max_size=16)
    ),
    "catalog.catalog_digest": _set("catalog.generation.catalog_digest", _digest("catalog")),
    "metadata_view.digest": _view,
    "trigger_set": _trigger_set,
    "policy.version": _set("policy.version", st.integers(1, 10_000)),
    "policy.bound": _set("policy.durable_orchestration.max_reads", st.integers(1000, 5000)),
}


@PROPS
@given(mutation=st.sampled_from(sorted(MUTATIONS)), data=st.data())
def test_every_identity_input_changes_the_digest(mutation: str, data: st.DataObject) -> None:
    source = _source("durable_send_email")
    base = compile_plan(source, _inputs())
    doc = inputs_doc()
    MUTATIONS[mutation](doc, data)
    changed = compile_plan(source, CompilerInputs.from_dict(doc))
    assert changed.plan_digest != base.plan_digest
    assert changed.verify()


@PROPS
@given(version=st.text(min_size=1, max_size=30).filter(lambda v: v != "nexus-flow-compiler/1"))
def test_compiler_version_changes_the_digest(version: str) -> None:
    source = _source("atomic_close_won")
    base = compile_plan(source, _inputs())
    other = compile_plan(source, _inputs(), compiler_version=version)
    assert other.plan_digest != base.plan_digest
    assert other.payload_digest == base.payload_digest  # same executable payload, new identity


@PROPS
@given(subject=st.text(alphabet="abcdefgh XYZ", min_size=1, max_size=20))
def test_subflow_change_changes_the_parent_digest(subject: str) -> None:
    base = compile_plan(_source("durable_subflow_effect"), _inputs())
    doc = inputs_doc()
    child = next(s for s in doc["subflows"] if s["api_name"] == "notify_owner")
    child["elements"][0]["inputs"]["subject"] = f"CONCAT(topic, '{subject}')"
    changed = compile_plan(_source("durable_subflow_effect"), CompilerInputs.from_dict(doc))
    assert changed.plan_digest != base.plan_digest
    assert {s.plan_digest for s in changed.subflows}.isdisjoint(
        {s.plan_digest for s in base.subflows}
    )


def test_unreferenced_catalog_entry_does_not_change_the_digest() -> None:
    # Only referenced entries (and the catalog digest) are part of the identity.
    base = compile_plan(_source("durable_send_email"), _inputs())
    doc = inputs_doc()
    _entry(doc, "charge_card")["capabilities"]["replay_policy"] = "not_replayable"
    assert (
        compile_plan(_source("durable_send_email"), CompilerInputs.from_dict(doc)).plan_digest
        == base.plan_digest
    )


def test_identical_inputs_give_identical_plans() -> None:
    for name in SUCCESS:
        a = compile_plan(_source(name), load_inputs())
        b = compile_plan(copy.deepcopy(_source(name)), load_inputs())
        assert a == b and a.plan_digest == b.plan_digest
        assert ExecutionPlan.from_dict(a.to_dict()) == a
