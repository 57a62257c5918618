"""Pure parts of the request-dedupe mechanism: keys, scopes and body digests."""

from __future__ import annotations

import pytest

from services import request_dedupe as rd
from services.errors import InvalidArgumentError
from services.proto import runtime_v1

SCOPE = rd.DedupeScope("org-1", "inst-1", "cap-1", "binding/v1:sha256:" + "a" * 64)


def _delete(
    request_id: str = "req-1", run: str = "run-1", version: int = 0
) -> runtime_v1.DeleteRunRequest:
    return runtime_v1.DeleteRunRequest(
        request_id=request_id, org_id="org-1", flow_run_id=run, expected_state_version=version
    )


def test_the_key_digests_the_body_without_the_request_id() -> None:
    a = rd.RequestKey.of(SCOPE, "DeleteRun", _delete("req-1"))
    b = rd.RequestKey.of(SCOPE, "DeleteRun", _delete("req-2"))
    c = rd.RequestKey.of(SCOPE, "DeleteRun", _delete("req-1", run="run-2"))
    assert (a.request_id, b.request_id) == ("req-1", "req-2")
    assert a.request_digest == b.request_digest
    assert a.request_digest != c.request_digest
    # The RPC is part of the digest: the same body sent to another RPC is another request.
    other = rd.RequestKey.of(SCOPE, "CancelRun", _delete("req-1"))
    assert other.request_digest != a.request_digest


def test_request_id_is_required_and_bounded() -> None:
    with pytest.raises(InvalidArgumentError) as missing:
        rd.RequestKey.of(SCOPE, "DeleteRun", _delete(""))
    assert (missing.value.field_path, missing.value.reason) == ("request_id", "missing_field")
    too_long = "r" * (rd.MAX_REQUEST_ID_LEN + 1)
    with pytest.raises(InvalidArgumentError) as long_id:
        rd.RequestKey.of(SCOPE, "DeleteRun", _delete(too_long))
    assert long_id.value.reason == "out_of_range"
    assert too_long not in long_id.value.safe_message  # never echoes client input


def test_scope_of_an_identity_keeps_every_component_it_carries() -> None:
    class Identity:
        def scope_components(self) -> dict[str, str | None]:
            return {
                "org_id": "org-1",
                "app_installation_id": "inst-1",
                "runtime_capability_id": None,
                "runtime_work_binding_digest": None,
            }

    scope = rd.DedupeScope.of_identity(Identity())
    assert scope == rd.DedupeScope("org-1", "inst-1", "", "")
    assert rd.DedupeScope.of_work_scope(SCOPE) == SCOPE
    with pytest.raises(ValueError):
        rd.DedupeScope("")


def test_reuse_error_names_the_field_and_reason() -> None:
    err = rd.RequestIdReusedError()
    assert (err.field_path, err.reason) == ("request_id", "request_id_reused")


def test_deduplicated_parses_its_response() -> None:
    resp = runtime_v1.DeleteRunResponse(run=runtime_v1.FlowRun(flow_run_id="run-1"))
    done: rd.Deduplicated[int] = rd.Deduplicated(None, resp.SerializeToString(), replayed=True)
    assert done.message(runtime_v1.DeleteRunResponse) == resp
    empty: rd.Deduplicated[int] = rd.Deduplicated(None, None)
    with pytest.raises(ValueError):
        empty.message(runtime_v1.DeleteRunResponse)
