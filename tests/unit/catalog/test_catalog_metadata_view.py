"""RuntimeMetadataView: normalization, content-addressed digest, diagnostics by path."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog_svc.domain import (
    METADATA_VIEW_DIGEST_KIND,
    DiagnosticCode,
    DomainValidationError,
    FieldType,
    RuntimeMetadataView,
    TriggerEvent,
)
from services.digest import is_digest
from tests.unit.catalog.factories import make_view, patch, shuffled, view_dict


def _shuffle_lists(value: Any, rnd: random.Random) -> Any:
    """Shuffle every list (all lists of a view are unordered) and every dict's key order."""
    if isinstance(value, dict):
        return shuffled({k: _shuffle_lists(v, rnd) for k, v in value.items()}, rnd)
    if isinstance(value, list):
        items = [_shuffle_lists(v, rnd) for v in value]
        rnd.shuffle(items)
        return items
    return value


def _issues(raw: dict[str, Any]) -> set[tuple[str, DiagnosticCode]]:
    with pytest.raises(DomainValidationError) as err:
        RuntimeMetadataView.from_dict(raw)
    return {(i.path, i.code) for i in err.value.issues}  # type: ignore[union-attr]


def test_from_dict_validates_normalizes_and_round_trips() -> None:
    view = make_view()
    assert view.validate() == []
    assert [o.api_name for o in view.objects] == ["Account", "Contact"]
    account = view.get_object("Account")
    assert account is not None
    assert [f.api_name for f in account.fields] == ["Balance", "Name", "Tier"]
    tier = account.field("Tier")
    assert tier is not None and tier.picklist_values == ("bronze", "gold", "silver")
    welcome = next(t for t in view.trigger_subscriptions if t.flow_api_name == "Welcome")
    assert welcome.events == (TriggerEvent.CREATE, TriggerEvent.UPDATE)
    assert RuntimeMetadataView.from_dict(json.loads(json.dumps(view.to_dict()))) == view
    assert is_digest(view.digest(), METADATA_VIEW_DIGEST_KIND)


@given(st.randoms(use_true_random=False))
def test_digest_is_order_insensitive(rnd: random.Random) -> None:
    assert (
        RuntimeMetadataView.from_dict(_shuffle_lists(view_dict(), rnd)).digest()
        == make_view().digest()
    )


def test_unnormalized_construction_digests_like_the_normalized_view() -> None:
    view = make_view()
    reversed_view = RuntimeMetadataView(
        objects=tuple(reversed(view.objects)),
        relationships=view.relationships,
        trigger_subscriptions=tuple(reversed(view.trigger_subscriptions)),
        actions=tuple(reversed(view.actions)),
    )
    assert reversed_view != view
    assert reversed_view.digest() == view.digest()
    assert reversed_view.normalized() == view


def test_action_types_are_normalized() -> None:
    raw = patch(view_dict(), {})
    raw["actions"][0]["action_type"] = "  ACME.Send_Invoice "
    view = RuntimeMetadataView.from_dict(raw)
    assert view.get_action("acme.send_invoice") is not None
    assert view.digest() == make_view().digest()


def _mutate(path: list[Any], value: Any) -> dict[str, Any]:
    raw = view_dict()
    node: Any = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["objects", 0, "fields", 0, "max_length"], 81),
        (["objects", 0, "fields", 0, "required"], False),
        (["objects", 0, "fields", 1, "scale"], 3),
        (["objects", 0, "fields", 2, "picklist_values"], ["gold", "silver", "bronze", "platinum"]),
        (["objects", 1, "fields", 2, "type"], "string"),
        (["trigger_subscriptions", 0, "events"], ["update"]),
        (["trigger_subscriptions", 0, "entry_condition"], "ISCHANGED(Name)"),
        (["trigger_subscriptions", 0, "timing"], "before_save"),
        (["trigger_subscriptions", 1, "flow_api_name"], "Normalize2"),
        (["trigger_subscriptions", 1, "dispatch_order"], 20),
        (["relationships"], []),
        (["actions", 0, "inputs", 0, "required"], False),
        (["actions", 0, "outputs"], []),
        (["actions", 1, "label"], "Update a record"),
    ],
)
def test_digest_is_content_sensitive(path: list[Any], value: Any) -> None:
    assert RuntimeMetadataView.from_dict(_mutate(path, value)).digest() != make_view().digest()


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            ["objects", 0, "fields", 0, "type"],
            "geolocation",
            ("objects[0].fields[0].type", DiagnosticCode.UNKNOWN_ENUM_VALUE),
        ),
        (
            ["objects", 0, "fields", 0, "type"],
            0,
            ("objects[0].fields[0].type", DiagnosticCode.MISSING_FIELD),
        ),
        (
            ["objects", 0, "fields", 0, "type"],
            99,
            ("objects[0].fields[0].type", DiagnosticCode.UNKNOWN_ENUM_VALUE),
        ),
        (
            ["relationships", 0, "parent_object_api_name"],
            "Opportunity",
            ("relationships[0].parent_object_api_name", DiagnosticCode.DANGLING_REFERENCE),
        ),
        (
            ["relationships", 0, "child_field_api_name"],
            "Missing",
            ("relationships[0].child_field_api_name", DiagnosticCode.DANGLING_REFERENCE),
        ),
        (
            ["relationships", 0, "child_field_api_name"],
            "Email",
            ("relationships[0].child_field_api_name", DiagnosticCode.INCONSISTENT),
        ),
        (
            ["trigger_subscriptions", 0, "object_api_name"],
            "Lead",
            ("trigger_subscriptions[0].object_api_name", DiagnosticCode.DANGLING_REFERENCE),
        ),
        (
            ["trigger_subscriptions", 0, "events"],
            [],
            ("trigger_subscriptions[0].events", DiagnosticCode.MISSING_FIELD),
        ),
        (
            ["trigger_subscriptions", 0, "events"],
            ["create", "create"],
            ("trigger_subscriptions[0].events[1]", DiagnosticCode.DUPLICATE_NAME),
        ),
        (
            ["trigger_subscriptions", 0, "events"],
            ["upsert"],
            ("trigger_subscriptions[0].events[0]", DiagnosticCode.UNKNOWN_ENUM_VALUE),
        ),
        (
            ["trigger_subscriptions", 0, "entry_condition"],
            "   ",
            ("trigger_subscriptions[0].entry_condition", DiagnosticCode.INVALID_FORMAT),
        ),
        (
            ["objects", 1, "fields", 0, "reference_object_api_name"],
            "Nowhere",
            ("objects[1].fields[0].reference_object_api_name", DiagnosticCode.DANGLING_REFERENCE),
        ),
        (
            ["objects", 0, "fields", 2, "picklist_values"],
            [],
            ("objects[0].fields[2].picklist_values", DiagnosticCode.MISSING_FIELD),
        ),
        (
            ["objects", 0, "fields", 2, "picklist_values"],
            ["a", "a"],
            ("objects[0].fields[2].picklist_values[1]", DiagnosticCode.DUPLICATE_NAME),
        ),
        (
            ["objects", 0, "fields", 0, "max_length"],
            0,
            ("objects[0].fields[0].max_length", DiagnosticCode.OUT_OF_RANGE),
        ),
        (
            ["objects", 0, "fields", 1, "precision"],
            39,
            ("objects[0].fields[1].precision", DiagnosticCode.OUT_OF_RANGE),
        ),
        (
            ["objects", 0, "fields", 1, "scale"],
            19,
            ("objects[0].fields[1].scale", DiagnosticCode.OUT_OF_RANGE),
        ),
        (
            ["objects", 1, "fields", 2, "max_length"],
            10,
            ("objects[1].fields[2].max_length", DiagnosticCode.INCONSISTENT),
        ),
        (
            ["objects", 0, "api_name"],
            "1Account",
            ("objects[0].api_name", DiagnosticCode.INVALID_FORMAT),
        ),
        (
            ["actions", 0, "action_type"],
            "acme..x",
            ("actions[0].action_type", DiagnosticCode.INVALID_FORMAT),
        ),
        (
            ["actions", 0, "inputs", 0, "type"],
            "blob",
            ("actions[0].inputs[0].type", DiagnosticCode.UNKNOWN_ENUM_VALUE),
        ),
        (
            ["objects", 0, "fields", 0, "colour"],
            "red",
            ("objects[0].fields[0].colour", DiagnosticCode.UNKNOWN_FIELD),
        ),
        (["objects", 0, "fields"], "Name", ("objects[0].fields", DiagnosticCode.INVALID_TYPE)),
    ],
)
def test_diagnostics_name_the_path(
    path: list[Any], value: Any, expected: tuple[str, DiagnosticCode]
) -> None:
    assert expected in _issues(_mutate(path, value))


@pytest.mark.parametrize(
    ("collection", "index", "key", "value", "expected_path"),
    [
        ("objects", 1, "api_name", "ACCOUNT", "objects[1]"),
        ("actions", 1, "action_type", "acme.send_invoice", "actions[1]"),
        ("trigger_subscriptions", 1, None, None, "trigger_subscriptions[2]"),
    ],
)
def test_duplicate_names_are_rejected(
    collection: str, index: int, key: str | None, value: Any, expected_path: str
) -> None:
    raw = view_dict()
    if key is None:  # an exact (flow, object, timing) repeat with other events
        raw[collection].append(dict(raw[collection][0], events=["delete"]))
    else:
        raw[collection][index][key] = value
    assert (expected_path, DiagnosticCode.DUPLICATE_NAME) in _issues(raw)


def test_duplicate_fields_and_parameters_are_rejected() -> None:
    raw = view_dict()
    raw["objects"][0]["fields"].append({"api_name": "name", "type": "text"})
    raw["actions"][0]["inputs"].append({"name": "invoice_id", "type": "string"})
    raw["relationships"].append(dict(raw["relationships"][0]))
    assert {
        ("objects[0].fields[3]", DiagnosticCode.DUPLICATE_NAME),
        ("actions[0].inputs[2]", DiagnosticCode.DUPLICATE_NAME),
        ("relationships[1]", DiagnosticCode.DUPLICATE_NAME),
    } <= _issues(raw)


def test_every_issue_is_reported_at_once() -> None:
    raw = _mutate(["objects", 0, "fields", 0, "type"], "geolocation")
    raw["trigger_subscriptions"][1]["object_api_name"] = "Lead"
    raw["unknown"] = True
    assert _issues(raw) == {
        ("objects[0].fields[0].type", DiagnosticCode.UNKNOWN_ENUM_VALUE),
        ("unknown", DiagnosticCode.UNKNOWN_FIELD),
    }  # shape issues first; semantic checks run once the shape is sound
    raw = view_dict()
    raw["trigger_subscriptions"][1]["object_api_name"] = "Lead"
    raw["objects"][1]["fields"][0]["reference_object_api_name"] = "Nowhere"
    assert len(_issues(raw)) == 3  # trigger, reference target, relationship's field target


def test_proto_numbers_are_accepted_for_enums() -> None:
    raw = _mutate(["objects", 0, "fields", 0, "type"], int(FieldType.STRING))
    raw["trigger_subscriptions"][0]["events"] = [2, 1]
    assert RuntimeMetadataView.from_dict(raw).digest() == make_view().digest()


def test_dispatch_order_zero_is_the_default_and_keeps_the_digest() -> None:
    """Views published before ``dispatch_order`` existed keep their digest: 0 is left out
    of the canonical form; a set order is content and round-trips."""
    assert (
        RuntimeMetadataView.from_dict(
            _mutate(["trigger_subscriptions", 1, "dispatch_order"], 0)
        ).digest()
        == make_view().digest()
    )
    ordered = RuntimeMetadataView.from_dict(
        _mutate(["trigger_subscriptions", 1, "dispatch_order"], 20)
    )
    normalize = next(
        t for t in ordered.to_dict()["trigger_subscriptions"] if t["flow_api_name"] == "Normalize"
    )  # type: ignore[index,union-attr]
    assert normalize["dispatch_order"] == 20
    assert RuntimeMetadataView.from_dict(ordered.to_dict()).digest() == ordered.digest()


@pytest.mark.parametrize("value", [-1, 1_000_001])
def test_dispatch_order_out_of_range_is_refused(value: int) -> None:
    issues = _issues(_mutate(["trigger_subscriptions", 1, "dispatch_order"], value))
    assert ("trigger_subscriptions[1].dispatch_order", DiagnosticCode.OUT_OF_RANGE) in issues


def test_dispatch_order_must_be_an_integer() -> None:
    issues = _issues(_mutate(["trigger_subscriptions", 1, "dispatch_order"], "first"))
    assert ("trigger_subscriptions[1].dispatch_order", DiagnosticCode.INVALID_TYPE) in issues


def test_contract_gap_facts_at_their_defaults_keep_existing_digests() -> None:
    """``read_only``, ``history_tracked`` and ``max_children`` (issue 10 item 8) are left
    out of the canonical form at their defaults: the digest a view had before they
    existed (pinned here) is unchanged."""
    pinned = (
        "runtime_metadata_view/v1:sha256:"
        "b606c42aee1bed46fa607817ebda18f410c17734abe4b2107f94210fe12ae044"
    )
    assert str(make_view().digest()) == pinned
    raw = view_dict()
    raw["objects"][0]["history_tracked"] = False
    raw["objects"][0]["fields"][0]["read_only"] = False
    raw["relationships"][0]["max_children"] = None
    assert str(RuntimeMetadataView.from_dict(raw).digest()) == pinned


def test_contract_gap_facts_are_content_and_round_trip() -> None:
    raw = view_dict()
    raw["objects"][0]["history_tracked"] = True
    raw["relationships"][0]["max_children"] = 25
    view = RuntimeMetadataView.from_dict(raw)
    assert view.digest() != make_view().digest()
    again = RuntimeMetadataView.from_dict(view.to_dict())
    assert again == view
    assert again.to_dict()["relationships"][0]["max_children"] == 25
