"""StartRun input-variable validation (§18.3, §17.3): pure."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_svc.runs import DeclaredVariable, validate_input_variables
from services.errors import InvalidArgumentError

VARS = (
    DeclaredVariable("recordId", "string", input=True, output=False, required=True),
    DeclaredVariable("count", "number", input=True, output=False),
    DeclaredVariable("n", "integer", input=True, output=False),
    DeclaredVariable("flag", "boolean", input=True, output=False),
    DeclaredVariable("ids", "string[]", input=True, output=False),
    DeclaredVariable("result", "string", input=False, output=True),
)


def _err(supplied: dict[str, Any]) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as err:
        validate_input_variables(VARS, supplied, max_bytes=10_000)
    return err.value


def test_valid_inputs_pass() -> None:
    got = validate_input_variables(
        VARS,
        {"recordId": "a", "count": 1.5, "n": 2, "flag": True, "ids": ["x"]},
        max_bytes=10_000,
    )
    assert got["count"] == 1.5


@pytest.mark.parametrize(
    ("supplied", "path"),
    [
        ({"recordId": "a", "nope": 1}, "input_variables.nope"),
        ({"recordId": "a", "result": "x"}, "input_variables.result"),  # output only
        ({}, "input_variables.recordId"),  # missing required
        ({"recordId": 5}, "input_variables.recordId"),
        ({"recordId": "a", "count": True}, "input_variables.count"),
        ({"recordId": "a", "n": 1.5}, "input_variables.n"),
        ({"recordId": "a", "flag": "yes"}, "input_variables.flag"),
        ({"recordId": "a", "ids": "x"}, "input_variables.ids"),
    ],
)
def test_invalid_inputs_name_the_path(supplied: dict[str, Any], path: str) -> None:
    assert _err(supplied).field_path == path


def test_every_issue_is_reported_once() -> None:
    err = _err({"a": 1, "recordId": 2})
    assert "a is not a declared" in err.safe_message and "recordId must be" in err.safe_message


def test_credential_material_is_rejected_without_echoing_it() -> None:
    token = "Bearer abcdefghijklmnop0123456789"
    err = _err({"recordId": token})
    assert err.reason == "checkpoint_credential_rejected"
    assert err.field_path == "input_variables.recordId"
    assert token not in err.safe_message


def test_oversize_inputs_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        validate_input_variables(VARS, {"recordId": "x" * 200}, max_bytes=50)
    assert err.value.reason == "checkpoint_too_large"
