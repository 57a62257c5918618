"""Shape rules of the ``.proto`` contracts, checked on protoc's own descriptors.

The descriptors (with source info, so comments are visible) are compiled from
``protos/`` into a temporary directory; nothing here needs the generated Python tree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc  # type: ignore[import-untyped]  # ships no stubs

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "protos"
SERVICES = ("catalog", "common", "effect", "runtime")
SCOPE_TYPE = ".nexus.flow.common.v1.TrustedRuntimeWorkScope"
READ_ONLY_VERBS = ("Get", "List", "Verify")
FIELD_COMMENT_PREFIXES = ("Required.", "Optional.", "Output only.")

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto
# field numbers used in SourceCodeInfo.Location.path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

ProtoPath = tuple[int, ...]


def _compile(out: Path) -> descriptor_pb2.FileDescriptorSet:
    well_known = resources.files("grpc_tools") / "_proto"
    sources = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    target = out / "contracts.binpb"
    rc = protoc.main(
        [
            "protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={well_known}",
            "--include_source_info",
            f"--descriptor_set_out={target}",
            *(str(PROTO_ROOT / s) for s in sources),
        ]
    )
    assert rc == 0, "protoc failed on protos/"
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(target.read_bytes())
    return fds


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[descriptor_pb2.FileDescriptorProto]:
    fds = _compile(tmp_path_factory.mktemp("descriptors"))
    assert fds.file, "no proto files compiled"
    return list(fds.file)


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def _walk_messages(
    messages: list[descriptor_pb2.DescriptorProto], path: ProtoPath, prefix: str
) -> Iterator[tuple[str, ProtoPath, descriptor_pb2.DescriptorProto]]:
    for i, message in enumerate(messages):
        if message.options.map_entry:
            # Synthetic map-entry messages have no source text to comment.
            continue
        here = (*path, i)
        name = f"{prefix}.{message.name}"
        yield name, here, message
        yield from _walk_messages(list(message.nested_type), (*here, _MSG_NESTED), name)


def _all_enums(
    fp: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, ProtoPath, descriptor_pb2.EnumDescriptorProto]]:
    for i, enum in enumerate(fp.enum_type):
        yield f"{fp.package}.{enum.name}", (_FILE_ENUM, i), enum
    for name, path, message in _walk_messages(list(fp.message_type), (_FILE_MESSAGE,), fp.package):
        for i, enum in enumerate(message.enum_type):
            yield f"{name}.{enum.name}", (*path, _MSG_ENUM, i), enum


def _leading_comments(fp: descriptor_pb2.FileDescriptorProto) -> dict[ProtoPath, str]:
    return {
        tuple(loc.path): loc.leading_comments.strip()
        for loc in fp.source_code_info.location
        if loc.leading_comments.strip()
    }


def test_every_service_package_exists_and_matches_its_directory(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    seen = set()
    for fp in files:
        directory = Path(fp.name).parent.as_posix()
        assert fp.package == directory.replace("/", "."), fp.name
        match = re.fullmatch(r"nexus\.flow\.([a-z]+)\.v1", fp.package)
        assert match is not None and match.group(1) in SERVICES, fp.package
        seen.add(match.group(1))
        assert fp.syntax == "proto3", fp.name
    assert seen == set(SERVICES)
    for svc in ("catalog", "effect", "runtime"):
        names = {Path(fp.name).name for fp in files if fp.package == f"nexus.flow.{svc}.v1"}
        assert names == {"service.proto", "request_response.proto", "message.proto"}, svc


def test_every_enum_starts_with_a_prefixed_unspecified_zero(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    problems = []
    for fp in files:
        for name, _, enum in _all_enums(fp):
            prefix = _upper_snake(enum.name) + "_"
            first = enum.value[0]
            if first.number != 0 or first.name != f"{prefix}UNSPECIFIED":
                problems.append(f"{name}: first value {first.name}={first.number}")
            problems += [
                f"{name}.{v.name}: not prefixed with {prefix}"
                for v in enum.value
                if not v.name.startswith(prefix)
            ]
    assert not problems, "\n".join(problems)


def test_every_rpc_has_its_own_verb_noun_request_and_response(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    used: list[str] = []
    services = set()
    for fp in files:
        for service in fp.service:
            services.add(f"{fp.package}.{service.name}")
            assert service.name.endswith("Service"), service.name
            for method in service.method:
                assert re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", method.name), method.name
                assert method.input_type == f".{fp.package}.{method.name}Request", method.name
                assert method.output_type == f".{fp.package}.{method.name}Response", method.name
                assert not method.client_streaming and not method.server_streaming
                used += [method.input_type, method.output_type]
    assert services == {
        "nexus.flow.catalog.v1.CatalogService",
        "nexus.flow.runtime.v1.FlowDefinitionService",
        "nexus.flow.runtime.v1.FlowRunService",
        "nexus.flow.runtime.v1.RecordService",
        "nexus.flow.runtime.v1.WakeSignalService",
        "nexus.flow.effect.v1.EffectOwnerService",
    }
    assert len(used) == len(set(used)), "a request/response type is shared between RPCs"


def test_every_element_has_a_leading_comment(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    missing: list[str] = []
    for fp in files:
        comments = _leading_comments(fp)

        def need(path: ProtoPath, what: str, comments: dict[ProtoPath, str] = comments) -> None:
            if path not in comments:
                missing.append(what)

        for name, path, message in _walk_messages(
            list(fp.message_type), (_FILE_MESSAGE,), fp.package
        ):
            need(path, f"message {name}")
            for i, field in enumerate(message.field):
                need((*path, _MSG_FIELD, i), f"field {name}.{field.name}")
            for i, oneof in enumerate(message.oneof_decl):
                need((*path, _MSG_ONEOF, i), f"oneof {name}.{oneof.name}")
        for name, path, enum in _all_enums(fp):
            need(path, f"enum {name}")
            for i, value in enumerate(enum.value):
                need((*path, _ENUM_VALUE, i), f"enum value {name}.{value.name}")
        for i, service in enumerate(fp.service):
            need((_FILE_SERVICE, i), f"service {fp.package}.{service.name}")
            for j, method in enumerate(service.method):
                need(
                    (_FILE_SERVICE, i, _SERVICE_METHOD, j),
                    f"rpc {fp.package}.{service.name}.{method.name}",
                )
    assert not missing, "missing leading comments:\n" + "\n".join(missing)


def test_field_comments_say_who_sets_the_field(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    bad: list[str] = []
    for fp in files:
        comments = _leading_comments(fp)
        for name, path, message in _walk_messages(
            list(fp.message_type), (_FILE_MESSAGE,), fp.package
        ):
            for i, field in enumerate(message.field):
                if field.HasField("oneof_index"):
                    # A oneof member's "Required/Optional" lives on the oneof comment.
                    continue
                comment = comments.get((*path, _MSG_FIELD, i), "")
                if not comment.startswith(FIELD_COMMENT_PREFIXES):
                    bad.append(f"{name}.{field.name}: {comment[:40]!r}")
            for i, oneof in enumerate(message.oneof_decl):
                comment = comments.get((*path, _MSG_ONEOF, i), "")
                if not any(p in comment for p in FIELD_COMMENT_PREFIXES):
                    bad.append(f"{name}.{oneof.name} (oneof): {comment[:40]!r}")
    assert not bad, "field comments must start with Required./Optional./Output only.:\n" + (
        "\n".join(bad)
    )


def _requests(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    messages = {f".{fp.package}.{m.name}": m for fp in files for m in fp.message_type}
    for fp in files:
        for service in fp.service:
            for method in service.method:
                yield method.name, messages[method.input_type]


def test_mutating_requests_carry_a_documented_request_id(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    comments = {}
    for fp in files:
        by_path = _leading_comments(fp)
        for i, message in enumerate(fp.message_type):
            for j, field in enumerate(message.field):
                comments[(message.name, field.name)] = by_path.get(
                    (_FILE_MESSAGE, i, _MSG_FIELD, j), ""
                )
    for rpc, request in _requests(files):
        fields = {f.name: f for f in request.field}
        if rpc.startswith(READ_ONLY_VERBS):
            assert "request_id" not in fields, f"read RPC {rpc} takes a request_id"
            continue
        assert "request_id" in fields, f"mutating RPC {rpc} lacks request_id"
        field = fields["request_id"]
        assert field.number == 1, rpc
        assert field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING, rpc
        comment = comments[(request.name, "request_id")]
        assert comment.startswith("Required.") and "dedupe" in comment, rpc


def test_requests_name_their_org_through_org_id_or_scope(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    """The auth interceptor finds the caller-named org by these exact field names."""
    for rpc, request in _requests(files):
        fields = {f.name: f for f in request.field}
        named = {"org_id", "scope"} & set(fields)
        assert len(named) == 1, f"{rpc}: needs exactly one of org_id/scope, has {named}"
        if "scope" in fields:
            assert fields["scope"].type_name == SCOPE_TYPE, rpc
        else:
            assert fields["org_id"].type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING, rpc


def test_scope_named_fields_are_always_the_trusted_scope_type(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    for fp in files:
        for name, _, message in _walk_messages(list(fp.message_type), (_FILE_MESSAGE,), fp.package):
            for field in message.field:
                if field.name == "scope":
                    assert field.type_name == SCOPE_TYPE, name
                if field.name == "org_id":
                    assert field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING, name


def test_common_state_enums_cover_the_spec_state_machines(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    enums = {name: enum for fp in files for name, _, enum in _all_enums(fp)}

    def values(name: str) -> set[str]:
        enum = enums[f"nexus.flow.common.v1.{name}"]
        prefix = _upper_snake(name) + "_"
        return {v.name.removeprefix(prefix) for v in enum.value} - {"UNSPECIFIED"}

    assert values("RunState") == {
        "ACCEPTED", "RUNNABLE", "RUNNING", "WAITING", "SUCCEEDED",
        "TERMINAL_FAILED", "QUARANTINED", "CANCEL_REQUESTED", "CANCELLED",
    }  # fmt: skip
    assert values("StepState") == {
        "PENDING", "CLAIMED", "RUNNING", "SUCCEEDED", "WAITING", "RETRY_SCHEDULED",
        "FAILED", "QUARANTINED", "CANCEL_REQUESTED", "CANCELLED",
    }  # fmt: skip
    assert values("AttemptOutcome") == {
        "STARTED", "COMMITTED", "ROLLED_BACK", "COMMIT_UNKNOWN", "ROLLBACK_UNKNOWN",
        "PRE_TRANSACTION_FAILED", "FENCED", "CANCELLED", "ABANDONED",
    }  # fmt: skip
    assert values("ExecutionProfile") == {
        "EMBEDDED_BEFORE_SAVE", "BOUNDED_ATOMIC", "DURABLE_ORCHESTRATION",
    }  # fmt: skip
    assert values("StepKind") == {
        "EMBEDDED_TRANSFORM", "PURE_COMPUTE", "CURRENT_READ", "VERIFIED_SNAPSHOT_READ",
        "BOUNDED_MUTATION", "DEPENDENCY_WAIT", "EFFECT_SUBMIT", "EFFECT_COMPLETION",
        "EXPLICIT_FAULT", "TERMINAL",
    }  # fmt: skip
    assert values("CompatibilityStatus") == {"RUNNING", "PAUSED", "FINISHED", "ERROR"}


def test_capability_descriptor_has_the_eleven_spec_capabilities(
    files: list[descriptor_pb2.FileDescriptorProto],
) -> None:
    common = next(fp for fp in files if fp.name.endswith("common/v1/capability.proto"))
    descriptor = next(m for m in common.message_type if m.name == "CapabilityDescriptor")
    assert [f.name for f in descriptor.field] == [
        "execution_class",
        "transaction_policy",
        "replay_policy",
        "fanout_bound",
        "read_contract",
        "lock_plan_contract",
        "effect_owner",
        "idempotency_policy",
        "output_durability",
        "security_policy",
        "minimum_capability_version",
    ]
