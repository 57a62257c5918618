"""Documented request limits (issue 10, item 9): one check for every RPC, the value never
echoed, and the table in docs/api-contract.md equal to the code and to the request
messages of the three services."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor

import services.proto  # noqa: F401  (registers the descriptors)
from services.errors import InvalidArgumentError
from services.proto import catalog_v1, common_v1, runtime_v1
from services.request_limits import (
    DEFAULT_MAX_CHARS,
    FIELD_LIMITS,
    MAX_DEPTH,
    check_request,
    limit_for,
)

ROOT = Path(__file__).resolve().parents[3]


def _refused(message: Any) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as info:
        check_request(message)
    return info.value


def test_an_over_long_identifier_names_the_field_and_never_echoes_the_value() -> None:
    secret = "s3cr3t" + "x" * 100
    error = _refused(runtime_v1.GetRunRequest(org_id="org-1", flow_run_id=secret))
    assert (error.field_path, error.reason) == ("flow_run_id", "too_long")
    assert error.attributes["max_length"] == "64"
    assert secret not in error.safe_message
    check_request(runtime_v1.GetRunRequest(org_id="org-1", flow_run_id="r" * 64))


def test_nested_and_repeated_fields_are_checked() -> None:
    scope = common_v1.TrustedRuntimeWorkScope(org_id="o" * 65)
    assert _refused(runtime_v1.StartRunRequest(scope=scope)).field_path == "scope.org_id"
    inventory = runtime_v1.GetInventoryRequest(flow_api_names=["ok", "n" * 65])
    assert _refused(inventory).field_path == "flow_api_names[1]"


def test_the_same_field_name_can_mean_two_things() -> None:
    long_name = "A" * 100  # a field name of 100 is fine, an object name is not
    field = catalog_v1.FieldSchema(api_name=long_name, type=1)
    ok = catalog_v1.MetadataView(objects=[catalog_v1.ObjectSchema(api_name="A", fields=[field])])
    check_request(catalog_v1.PublishMetadataViewRequest(view=ok))
    bad = catalog_v1.MetadataView(objects=[catalog_v1.ObjectSchema(api_name=long_name)])
    error = _refused(catalog_v1.PublishMetadataViewRequest(view=bad))
    assert error.field_path == "view.objects[0].api_name"


def test_unknown_enum_numbers_are_refused() -> None:
    request = runtime_v1.ListRunsRequest()
    request.runtime_states.append(99)  # type: ignore[arg-type]
    error = _refused(request)
    assert (error.field_path, error.reason) == ("runtime_states[0]", "unknown_enum_value")


@pytest.mark.parametrize(
    ("seconds", "nanos"), [(0, -1), (0, 1_000_000_000), (2**62, 0), (-62_135_596_801, 0)]
)
def test_unrepresentable_timestamps_are_refused(seconds: int, nanos: int) -> None:
    request = runtime_v1.ListRunsRequest()
    request.created_before.seconds, request.created_before.nanos = seconds, nanos
    error = _refused(request)
    assert (error.field_path, error.reason) == ("created_before", "invalid_timestamp")


def test_unrepresentable_durations_are_refused() -> None:
    request = runtime_v1.StartRunRequest()
    request.wait_budget.seconds, request.wait_budget.nanos = 5, -1
    assert _refused(request).reason == "invalid_duration"


def test_non_finite_numbers_in_a_struct_are_refused() -> None:
    request = runtime_v1.CreateRecordRequest(object_api_name="Contact")
    request.fields.fields["Amount"].number_value = math.nan
    error = _refused(request)
    assert error.reason == "non_finite_number"
    assert error.field_path == "fields.fields[Amount].number_value"


def test_struct_string_values_are_not_name_limited_and_long_keys_are_not_echoed() -> None:
    request = runtime_v1.CreateRecordRequest(object_api_name="Contact")
    request.fields.update({"Description": "d" * 100_000})
    check_request(request)
    request.fields.update({"k" * 2_000: 1})
    error = _refused(request)
    assert error.field_path == "fields.fields[<long key>]"
    assert "k" * 100 not in error.field_path


def test_nesting_beyond_the_bound_is_refused() -> None:
    value: Any = 1
    for _ in range(60):  # two checked levels per Struct level (Value, Struct)
        value = {"n": value}
    request = runtime_v1.CreateRecordRequest(object_api_name="Contact")
    request.fields.update(value)
    assert _refused(request).reason == "too_deep"
    assert MAX_DEPTH < 60 * 2


def _request_string_fields() -> dict[str, set[str]]:
    """Every string field reachable from a request of the three services:
    ``{field name: {message full names}}``."""
    pool = descriptor_pool.Default()
    out: dict[str, set[str]] = {}
    seen: set[str] = set()

    def walk(desc: Any) -> None:
        if desc.full_name in seen:
            return
        seen.add(desc.full_name)
        for f in desc.fields:
            if f.type == FieldDescriptor.TYPE_STRING:
                out.setdefault(f.name, set()).add(desc.full_name)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                walk(f.message_type)

    for package in ("catalog", "runtime", "effect"):
        file = pool.FindFileByName(f"nexus/flow/{package}/v1/service.proto")
        for service in file.services_by_name.values():
            for method in service.methods:
                walk(method.input_type)
    return out


def test_every_request_string_field_has_a_documented_limit() -> None:
    undocumented = {
        name: owners
        for name, owners in _request_string_fields().items()
        if name not in FIELD_LIMITS
        and not all(f"{o}.{name}" == "google.protobuf.Value.string_value" for o in owners)
        and not all(o.startswith("google.protobuf.") for o in owners)
    }
    assert undocumented == {}, "add these to FIELD_LIMITS and docs/api-contract.md"


def _docs_table() -> dict[str, int]:
    text = (ROOT / "docs/api-contract.md").read_text(encoding="utf-8")
    section = text[text.index("## Identifier and name limits") :]
    out: dict[str, int] = {}
    for limit, fields in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.M):
        for name in re.findall(r"`([\w.]+)`", fields):
            out[name] = int(limit)
    return out


def test_docs_table_states_the_code() -> None:
    docs = _docs_table()
    for name, limit in FIELD_LIMITS.items():
        assert docs.get(name) == limit, name
    assert docs["ObjectSchema.api_name"] == limit_for(
        "nexus.flow.catalog.v1.ObjectSchema", "api_name"
    )
    assert docs["page_token"] == DEFAULT_MAX_CHARS
