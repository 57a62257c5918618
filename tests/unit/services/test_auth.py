"""Workload credentials, the auth interceptor and request-scope checks (no network)."""

from __future__ import annotations

import base64
import dataclasses
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import grpc.aio
import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from services.auth import (
    OPERATOR_ROLES,
    AuthFailure,
    AuthInterceptor,
    CredentialSource,
    CredentialVerifier,
    TrustedIdentity,
    WorkloadClaims,
    bearer_metadata,
    check_request_scope,
    current_identity,
    ensure_dev_keys,
    generate_keypair,
    identity_context,
    load_signing_key,
    load_trusted_keys,
    mint_credential,
    server_credentials,
)
from services.config import ConfigError, ServiceName, load_config
from services.digest import versioned_digest
from services.errors import ErrorMappingInterceptor, PermissionDeniedError, UnauthenticatedError
from services.logging import redact

NOW = 1_700_000_000
SKEW = 30
DIGEST = versioned_digest("runtime_work_binding", {"b": 1})
OTHER_DIGEST = versioned_digest("runtime_work_binding", {"b": 2})
PRIVATE, PUBLIC = generate_keypair()

CLAIMS = WorkloadClaims(
    subject="runtime-worker",
    audiences=(ServiceName.CATALOG, ServiceName.RUNTIME),
    org_id="org-1",
    app_installation_id="app-1",
    runtime_capability_id="cap-1",
    runtime_work_binding_digest=DIGEST,
    roles=("worker",),
)


def verifier(audience: ServiceName = ServiceName.CATALOG, now: float = NOW) -> CredentialVerifier:
    return CredentialVerifier({"k1": PUBLIC}, audience, clock_skew_s=SKEW, now=lambda: now)


def mint(
    claims: WorkloadClaims = CLAIMS, *, kid: str = "k1", ttl: float = 300, now: float = NOW
) -> str:
    return mint_credential(PRIVATE, kid, claims, ttl_s=ttl, now=now)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def signed(header: object, claims_bytes: bytes) -> str:
    """A correctly signed credential around arbitrary header/claims bytes."""
    signing_input = f"nfw1.{b64(json.dumps(header).encode())}.{b64(claims_bytes)}"
    return f"{signing_input}.{b64(PRIVATE.sign(signing_input.encode()))}"


# --- credentials ------------------------------------------------------------------


def test_round_trip_yields_the_trusted_identity() -> None:
    identity = verifier().verify(mint())
    assert identity.subject == "runtime-worker"
    assert identity.audiences == ("catalog", "runtime")
    assert identity.org_id == "org-1" and identity.org.app_installation_id == "app-1"
    assert identity.work_scope is not None
    assert identity.work_scope.runtime_work_binding_digest == DIGEST
    assert identity.require_work_scope().runtime_capability_id == "cap-1"
    assert identity.roles == frozenset({"worker"})
    assert (identity.key_id, identity.issued_at, identity.expires_at) == ("k1", NOW, NOW + 300)


def test_org_only_credential_has_no_work_scope() -> None:
    claims = WorkloadClaims(subject="flowctl", audiences=(ServiceName.RUNTIME,), org_id="org-1")
    identity = verifier(ServiceName.RUNTIME).verify(mint(claims))
    assert identity.work_scope is None and identity.runtime_capability_id is None
    with pytest.raises(PermissionDeniedError):
        identity.require_work_scope()


def _other_key_forgery() -> str:
    other, _ = generate_keypair()
    return mint_credential(other, "k1", CLAIMS, ttl_s=300, now=NOW)


def _tampered_claims() -> str:
    head, _, sig = mint().rpartition(".")
    prefix, header, claims = head.split(".")
    body = json.loads(base64.urlsafe_b64decode(claims + "=="))
    body["org_id"] = "org-2"
    return f"{prefix}.{header}.{b64(json.dumps(body).encode())}.{sig}"


@pytest.mark.parametrize(
    ("credential", "failure"),
    [
        (None, AuthFailure.MISSING),
        ("", AuthFailure.MISSING),
        ("garbage", AuthFailure.MALFORMED),
        ("nfw2" + mint()[4:], AuthFailure.MALFORMED),
        (mint() + ".extra", AuthFailure.MALFORMED),
        ("nfw1.!!!.e30.AA", AuthFailure.MALFORMED),
        ("nfw1." + "A" * 9000 + ".e30.AA", AuthFailure.MALFORMED),
        (signed({"alg": "none", "kid": "k1"}, b"{}"), AuthFailure.MALFORMED),
        (signed({"alg": "EdDSA", "kid": "k1"}, b"not json"), AuthFailure.MALFORMED),
        (signed({"alg": "EdDSA", "kid": "k1"}, b'{"sub":"a","sub":"b"}'), AuthFailure.MALFORMED),
        (
            signed({"alg": "EdDSA", "kid": "k1"}, json.dumps(CLAIMS.to_json()).encode()),
            AuthFailure.MALFORMED,
        ),
        (mint(kid="k-unknown"), AuthFailure.UNKNOWN_KEY),
        (_other_key_forgery(), AuthFailure.BAD_SIGNATURE),
        (_tampered_claims(), AuthFailure.BAD_SIGNATURE),
        (mint(now=NOW - 300 - SKEW - 1), AuthFailure.EXPIRED),
        (mint(now=NOW + SKEW + 1), AuthFailure.NOT_YET_VALID),
        (
            mint(WorkloadClaims(subject="x", audiences=(ServiceName.RUNTIME,), org_id="o")),
            AuthFailure.WRONG_AUDIENCE,
        ),
    ],
    ids=lambda v: v.name if isinstance(v, AuthFailure) else None,
)
def test_refusals_have_distinct_reasons(credential: str | None, failure: AuthFailure) -> None:
    with pytest.raises(UnauthenticatedError) as info:
        verifier().verify(credential)
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert info.value.reason == failure.value
    if credential:
        assert credential not in info.value.safe_message


def test_clock_skew_is_tolerated_at_both_ends() -> None:
    verifier(now=NOW + 300 + SKEW).verify(mint())  # just expired, within skew
    verifier(now=NOW - SKEW).verify(mint())  # issued slightly in the future


def test_an_accepted_credential_is_remembered_but_its_times_are_checked_on_every_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The signature of a byte-identical credential is checked once (the verifier
    remembers what it accepted); expiry and not-yet-valid are checked on every use, a
    credential that expired is forgotten, and a refused one is never remembered."""
    clock = [float(NOW)]
    v = CredentialVerifier(
        {"k1": PUBLIC}, ServiceName.CATALOG, clock_skew_s=SKEW, now=lambda: clock[0]
    )
    token = mint()
    verified: list[int] = []
    real = v._verify

    def counting(credential: str) -> TrustedIdentity:
        verified.append(1)
        return real(credential)

    monkeypatch.setattr(v, "_verify", counting)
    first = v.verify(token)
    assert v.verify(token) == first and len(verified) == 1
    tampered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    for _ in range(2):
        with pytest.raises(UnauthenticatedError) as bad:
            v.verify(tampered)
        assert bad.value.reason == AuthFailure.BAD_SIGNATURE.value
    assert len(verified) == 3  # a refusal is not remembered
    clock[0] = NOW + 300 + SKEW + 1
    with pytest.raises(UnauthenticatedError) as late:
        v.verify(token)
    assert late.value.reason == AuthFailure.EXPIRED.value
    clock[0] = NOW  # a clock stepped back: the forgotten credential is verified again
    assert v.verify(token) == first and len(verified) == 4


def test_a_remembered_credential_issued_in_the_future_is_not_yet_valid() -> None:
    clock = [float(NOW)]
    v = CredentialVerifier(
        {"k1": PUBLIC}, ServiceName.CATALOG, clock_skew_s=SKEW, now=lambda: clock[0]
    )
    token = mint(now=NOW + SKEW)
    v.verify(token)
    clock[0] = NOW - 1
    with pytest.raises(UnauthenticatedError) as early:
        v.verify(token)
    assert early.value.reason == AuthFailure.NOT_YET_VALID.value


def test_the_remembered_credentials_are_bounded() -> None:
    from services.auth import credentials

    v = verifier()
    tokens = [mint(ttl=300 + i) for i in range(credentials._REMEMBERED + 5)]
    for t in tokens:
        v.verify(t)
    assert len(v._accepted) == credentials._REMEMBERED
    assert tokens[0] not in v._accepted and tokens[-1] in v._accepted


@pytest.mark.parametrize(
    "kwargs",
    [
        {"runtime_capability_id": "cap"},  # capability without installation
        {
            "app_installation_id": "a",
            "runtime_work_binding_digest": DIGEST,
        },  # digest without capability
        {
            "app_installation_id": "a",
            "runtime_capability_id": "c",
            "runtime_work_binding_digest": "nope",
        },
        {"org_id": ""},
    ],
)
def test_claims_validation(kwargs: dict[str, str]) -> None:
    base: dict[str, Any] = {"subject": "w", "audiences": (ServiceName.RUNTIME,), "org_id": "o"}
    with pytest.raises(ValueError):
        WorkloadClaims(**(base | kwargs))


def test_credential_source_reuses_then_refreshes() -> None:
    clock = [float(NOW)]
    source = CredentialSource(
        PRIVATE, "k1", CLAIMS, ttl_s=300, refresh_margin_s=60, now=lambda: clock[0]
    )
    first = source()
    clock[0] += 200
    assert source() == first
    clock[0] += 100  # past ttl - margin
    second = source()
    assert second != first
    assert verifier(now=clock[0]).verify(second).issued_at == int(clock[0])


# --- key files --------------------------------------------------------------------


def test_dev_keys_are_created_once_private_and_usable(tmp_path: Path) -> None:
    files = ensure_dev_keys(tmp_path, env="development")
    assert files.signing_key == tmp_path / "auth" / "dev_signing_key.pem"
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "auth").stat().st_mode) == 0o700
    key_pem = files.signing_key.read_bytes()
    assert ensure_dev_keys(tmp_path, env="test") == files
    assert files.signing_key.read_bytes() == key_pem  # not regenerated

    operator = dataclasses.replace(CLAIMS, roles=OPERATOR_ROLES)
    credential = mint_credential(
        load_signing_key(files.signing_key), "dev", operator, ttl_s=60, now=NOW
    )
    keys = load_trusted_keys(files.trusted_keys)
    assert (
        CredentialVerifier(keys, ServiceName.RUNTIME, now=lambda: NOW).verify(credential).subject
        == "runtime-worker"
    )


def test_dev_keys_add_a_missing_kid_and_refuse_a_conflicting_one(tmp_path: Path) -> None:
    files = ensure_dev_keys(tmp_path, env="development", key_id="a")
    ensure_dev_keys(tmp_path, env="development", key_id="b")
    services = {"runtime-service", "effect-owner-service"}
    assert set(load_trusted_keys(files.trusted_keys)) == {"a", "b"} | services
    doc = json.loads(files.trusted_keys.read_text())
    pem = PUBLIC.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
    doc["keys"]["a"]["public_key"] = pem
    files.trusted_keys.write_text(json.dumps(doc))
    with pytest.raises(ConfigError):
        ensure_dev_keys(tmp_path, env="development", key_id="a")


def test_dev_keys_refused_in_production(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="production"):
        ensure_dev_keys(tmp_path, env="production")
    assert not (tmp_path / "auth").exists()


@pytest.mark.parametrize("content", ["", "[]", "{}", '{"k": "not a pem"}'])
def test_bad_trusted_keys_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "trusted.json"
    path.write_text(content)
    with pytest.raises(ConfigError):
        load_trusted_keys(path)
    with pytest.raises(ConfigError):
        load_trusted_keys(tmp_path / "missing.json")


def test_server_credentials_off_without_tls(tmp_path: Path) -> None:
    cfg = load_config(ServiceName.RUNTIME, {"FLOW_DATA_DIR": str(tmp_path)})
    assert server_credentials(cfg) is None


def test_log_redaction() -> None:
    credential = mint()
    line = redact(
        f"call failed metadata=[('authorization', 'Bearer {credential}')] raw={credential}"
    )
    assert credential not in line
    assert "<redacted>" in line
    assert redact("bearer abc.def") == "bearer <redacted>"


# --- request-scope inspection -------------------------------------------------------


def _request_class() -> Any:
    """``Request{org_id, scope: Scope{4 components}, binding: Binding{3}, payload}``."""
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="nexus_test_scope.proto", package="nexustest", syntax="proto3"
    )
    components = [
        "org_id",
        "app_installation_id",
        "runtime_capability_id",
        "runtime_work_binding_digest",
    ]
    for name, fields in (("Scope", components), ("Binding", components[:3])):
        msg = fdp.message_type.add(name=name)
        for number, field in enumerate(fields, start=1):
            msg.field.add(name=field, number=number, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    req = fdp.message_type.add(name="Request")
    req.field.add(name="org_id", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    req.field.add(
        name="scope",
        number=2,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        type_name=".nexustest.Scope",
    )
    req.field.add(
        name="binding",
        number=3,
        type=f.TYPE_MESSAGE,
        label=f.LABEL_OPTIONAL,
        type_name=".nexustest.Binding",
    )
    req.field.add(name="payload", number=4, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("nexustest.Request"))


Request = _request_class()
IDENTITY: TrustedIdentity = verifier().verify(mint())
FULL_SCOPE = {
    "org_id": "org-1",
    "app_installation_id": "app-1",
    "runtime_capability_id": "cap-1",
    "runtime_work_binding_digest": DIGEST,
}


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {},
        {"payload": "x"},
        {"org_id": "org-1"},
        {"scope": FULL_SCOPE},
        {"scope": {"org_id": "org-1"}},  # empty components are not compared
        {
            "binding": {
                "org_id": "org-1",
                "app_installation_id": "app-1",
                "runtime_capability_id": "cap-1",
            }
        },
    ],
)
def test_matching_requests_pass(request_kwargs: dict[str, Any]) -> None:
    check_request_scope(Request(**request_kwargs), IDENTITY)


@pytest.mark.parametrize(
    ("request_kwargs", "field_path"),
    [
        ({"org_id": "org-2"}, "org_id"),
        ({"scope": FULL_SCOPE | {"org_id": "org-2"}}, "scope.org_id"),
        ({"scope": FULL_SCOPE | {"app_installation_id": "app-2"}}, "scope.app_installation_id"),
        ({"scope": FULL_SCOPE | {"runtime_capability_id": "cap-2"}}, "scope.runtime_capability_id"),
        (
            {"scope": FULL_SCOPE | {"runtime_work_binding_digest": OTHER_DIGEST}},
            "scope.runtime_work_binding_digest",
        ),
        ({"binding": {"org_id": "org-2"}}, "binding.org_id"),
        (
            {"binding": {"org_id": "org-1", "runtime_capability_id": "cap-9"}},
            "binding.runtime_capability_id",
        ),
    ],
)
def test_mismatching_requests_are_denied(request_kwargs: dict[str, Any], field_path: str) -> None:
    with pytest.raises(PermissionDeniedError) as info:
        check_request_scope(Request(**request_kwargs), IDENTITY)
    assert info.value.field_path == field_path
    assert info.value.reason == "scope_mismatch"
    assert "org-2" not in info.value.safe_message


def test_scope_component_the_credential_lacks_is_denied() -> None:
    org_only = verifier().verify(
        mint(WorkloadClaims(subject="w", audiences=(ServiceName.CATALOG,), org_id="org-1"))
    )
    check_request_scope(Request(scope={"org_id": "org-1"}), org_only)
    with pytest.raises(PermissionDeniedError):
        check_request_scope(Request(scope=FULL_SCOPE), org_only)


def test_non_protobuf_requests_pass() -> None:
    check_request_scope({"org_id": "org-2"}, IDENTITY)


# --- interceptors, driven without a network ------------------------------------------


class Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, Any], ...] = ()


class FakeContext:
    def __init__(self) -> None:
        self.aborts: list[tuple[grpc.StatusCode, str]] = []

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self.aborts.append((code, details))
        raise grpc.aio.AbortError()


METHOD = "/nexus.test.v1.Scoped/Call"
seen: list[TrustedIdentity] = []


async def servicer(request: Any, _ctx: Any) -> Any:
    seen.append(current_identity())
    return Request(payload="ok:" + request.payload)


def _base_handler() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        servicer, Request.FromString, Request.SerializeToString
    )


async def _chain(details: Details, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The production order: error mapping outside, auth inside."""
    auth = AuthInterceptor(verifier())

    async def to_auth(d: Any) -> Any:
        async def to_handler(_: Any) -> Any:
            return handler

        return await auth.intercept_service(to_handler, d)

    return await ErrorMappingInterceptor().intercept_service(to_auth, details)


async def _invoke(metadata: tuple[tuple[str, Any], ...], body: Any) -> tuple[Any, FakeContext]:
    seen.clear()
    handler = await _chain(Details(METHOD, metadata), _base_handler())
    ctx = FakeContext()
    raw = body.SerializeToString()
    request = handler.request_deserializer(raw) if handler.request_deserializer else raw
    try:
        return await handler.unary_unary(request, ctx), ctx
    except grpc.aio.AbortError:
        return None, ctx


@pytest.mark.parametrize(
    ("metadata", "reason_message"),
    [
        ((), "workload credential missing"),
        ((("authorization", "Basic abc"),), "workload credential malformed"),
        (
            (("authorization", "Bearer " + mint()), ("authorization", "Bearer " + mint())),
            "workload credential malformed",
        ),
        (bearer_metadata("nfw1.x.y.z"), "workload credential malformed"),
        (bearer_metadata(mint(now=NOW - 3600)), "workload credential expired"),
        (bearer_metadata(mint(now=NOW + 3600)), "workload credential not yet valid"),
        (bearer_metadata(_other_key_forgery()), "workload credential signature invalid"),
        (bearer_metadata(mint(kid="k9")), "workload credential signed by an untrusted key"),
        (
            bearer_metadata(
                mint(
                    WorkloadClaims(
                        subject="x", audiences=(ServiceName.EFFECT_OWNER,), org_id="org-1"
                    )
                )
            ),
            "workload credential not issued for this service",
        ),
    ],
)
async def test_interceptor_refuses_bad_credentials(
    metadata: tuple[tuple[str, Any], ...], reason_message: str
) -> None:
    result, ctx = await _invoke(metadata, Request(payload="p"))
    assert result is None and seen == []
    assert ctx.aborts == [(grpc.StatusCode.UNAUTHENTICATED, reason_message)]


async def test_refused_request_is_never_deserialized() -> None:
    handler = await _chain(Details(METHOD), _base_handler())
    assert handler.request_deserializer is None


@pytest.mark.parametrize(
    "body",
    [
        Request(org_id="org-2", payload="p"),
        Request(scope={**FULL_SCOPE, "runtime_capability_id": "cap-2"}),
    ],
)
async def test_interceptor_denies_body_scope_mismatch(body: Any) -> None:
    result, ctx = await _invoke(bearer_metadata(mint()), body)
    assert result is None and seen == []  # the servicer never ran
    assert [code for code, _ in ctx.aborts] == [grpc.StatusCode.PERMISSION_DENIED]


async def test_matching_request_reaches_servicer_with_identity() -> None:
    result, ctx = await _invoke(
        bearer_metadata(mint()), Request(org_id="org-1", scope=FULL_SCOPE, payload="p")
    )
    assert ctx.aborts == []
    assert result.payload == "ok:p"
    [identity] = seen
    assert identity.subject == "runtime-worker" and identity.org_id == "org-1"
    with pytest.raises(UnauthenticatedError):
        current_identity()  # not leaked past the call


@pytest.mark.parametrize(
    "method",
    [
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    ],
)
async def test_health_and_reflection_need_no_credential(method: str) -> None:
    handler = _base_handler()

    async def continuation(_: Any) -> Any:
        return handler

    assert (
        await AuthInterceptor(verifier()).intercept_service(continuation, Details(method))
        is handler
    )


async def test_request_stream_is_checked_message_by_message() -> None:
    received: list[str] = []

    async def consume(requests: AsyncIterator[Any], _ctx: Any) -> Any:
        async for r in requests:
            received.append(r.payload)
        return Request()

    async def requests() -> AsyncIterator[Any]:
        yield Request(org_id="org-1", payload="a")
        yield Request(org_id="org-2", payload="b")

    handler = await _chain(
        Details(METHOD, bearer_metadata(mint())),
        grpc.stream_unary_rpc_method_handler(
            consume, Request.FromString, Request.SerializeToString
        ),
    )
    ctx = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await handler.stream_unary(requests(), ctx)
    assert received == ["a"]
    assert [code for code, _ in ctx.aborts] == [grpc.StatusCode.PERMISSION_DENIED]


def test_current_identity_outside_a_call() -> None:
    with pytest.raises(UnauthenticatedError):
        current_identity()
    with identity_context(IDENTITY):
        assert current_identity() is IDENTITY
    with pytest.raises(UnauthenticatedError):
        current_identity()
