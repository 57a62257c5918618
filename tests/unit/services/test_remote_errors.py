"""The one client-side status map (services.remote_errors): every remote status becomes
one of our own errors, never INTERNAL, with a bounded message."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from services.errors import (
    ERROR_DETAIL_METADATA_KEY,
    FailedPreconditionError,
    FlowError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    encode_error_detail,
)
from services.remote_errors import remote_error


def _rpc_error(
    code: grpc.StatusCode, details: str = "", trailing: tuple[tuple[str, bytes], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


@pytest.mark.parametrize(
    ("code", "expected", "reason"),
    [
        (grpc.StatusCode.NOT_FOUND, NotFoundError, "not_found"),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError, "catalog_rejected"),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidArgumentError, "catalog_rejected"),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError, "catalog_state"),
        (grpc.StatusCode.ALREADY_EXISTS, FailedPreconditionError, "catalog_state"),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError, "permission_denied"),
        (grpc.StatusCode.UNAUTHENTICATED, UnavailableError, "catalog_refused_credential"),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError, "catalog_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, UnavailableError, "catalog_unavailable"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, UnavailableError, "catalog_unavailable"),
        (grpc.StatusCode.ABORTED, UnavailableError, "catalog_unavailable"),
        (grpc.StatusCode.INTERNAL, UnavailableError, "catalog_failed"),
        (grpc.StatusCode.UNKNOWN, UnavailableError, "catalog_failed"),
        (grpc.StatusCode.UNIMPLEMENTED, UnavailableError, "catalog_failed"),
    ],
)
def test_each_remote_status_maps_to_one_of_our_errors(
    code: grpc.StatusCode, expected: type[FlowError], reason: str
) -> None:
    error = remote_error(_rpc_error(code, "x"), service="catalog", what="metadata view", key="k")
    assert type(error) is expected
    assert error.reason == reason


def test_no_remote_status_reads_as_internal() -> None:
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        error = remote_error(_rpc_error(code), service="catalog", what="view")
        assert error.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), code


def test_the_caller_decides_what_missing_means() -> None:
    error = remote_error(
        _rpc_error(grpc.StatusCode.NOT_FOUND),
        service="catalog",
        what="work binding",
        not_found=lambda: FailedPreconditionError("no binding", reason="metadata_view_missing"),
    )
    assert isinstance(error, FailedPreconditionError)
    assert error.reason == "metadata_view_missing"


def test_the_remote_message_is_bounded_and_its_reason_travels() -> None:
    detail = encode_error_detail(FailedPreconditionError("held", reason="artifact_referenced"))
    assert detail is not None
    error = remote_error(
        _rpc_error(
            grpc.StatusCode.FAILED_PRECONDITION,
            "y" * 100_000,
            ((ERROR_DETAIL_METADATA_KEY, detail),),
        ),
        service="catalog",
        what="generation",
        key="g1",
    )
    assert len(error.safe_message) < 300
    assert error.attributes["remote_reason"] == "artifact_referenced"
