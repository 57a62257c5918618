"""The generated Python tree: importable, complete re-exports, deterministic, in sync.

Needs ``scripts/gen_protos.py`` to have run (``make proto``); the sync test says so when
the tree is stale or missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
GENERATOR = REPO_ROOT / "scripts" / "gen_protos.py"
NAMESPACES = ("catalog_v1", "common_v1", "effect_v1", "runtime_v1")


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos_under_test", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generation_is_deterministic_and_the_checked_out_tree_is_current(
    gen: Any, tmp_path: Path
) -> None:
    first, second = tmp_path / "a" / "nexus", tmp_path / "b" / "nexus"
    gen.generate(target=first)
    gen.generate(target=second)
    assert _tree(first) == _tree(second)
    # Re-running into an up-to-date tree writes and removes nothing.
    assert gen.generate(target=first) == (0, 0)
    current = _tree(gen.GENERATED_ROOT) if gen.GENERATED_ROOT.is_dir() else {}
    assert current == _tree(first), "services/proto/nexus is stale: run scripts/gen_protos.py"


def test_generation_fails_on_a_protoc_error_and_keeps_the_old_tree(
    gen: Any, tmp_path: Path
) -> None:
    protos = tmp_path / "protos" / "nexus" / "flow" / "broken" / "v1"
    protos.mkdir(parents=True)
    (protos / "message.proto").write_text(
        'syntax = "proto3";\npackage nexus.flow.broken.v1;\nmessage M { Missing m = 1; }\n'
    )
    target = tmp_path / "out" / "nexus"
    target.mkdir(parents=True)
    (target / "keep.txt").write_text("old")
    with pytest.raises(gen.GenerationError, match="protoc exited"):
        gen.generate(proto_root=tmp_path / "protos", target=target)
    assert (target / "keep.txt").read_text() == "old"


def test_rewrite_touches_only_imports_of_our_tree(gen: Any) -> None:
    source = (
        "from nexus.flow.common.v1 import binding_pb2 as b\n"
        "import nexus.flow.runtime.v1.message_pb2\n"
        "x: nexus.flow.runtime.v1.message_pb2.FlowRun\n"
        "from google.protobuf import struct_pb2\n"
        "path = '/nexus.flow.runtime.v1.FlowRunService/StartRun'\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'nexus.flow.common.v1.x_pb2', g)\n"
        "name = '.nexus.flow.common.v1.RunState'\n"
    )
    assert gen.rewrite_imports(source) == (
        "from services.proto.nexus.flow.common.v1 import binding_pb2 as b\n"
        "import services.proto.nexus.flow.runtime.v1.message_pb2\n"
        "x: services.proto.nexus.flow.runtime.v1.message_pb2.FlowRun\n"
        "from google.protobuf import struct_pb2\n"
        "path = '/nexus.flow.runtime.v1.FlowRunService/StartRun'\n"
        "_builder.BuildTopDescriptorsAndMessages("
        "DESCRIPTOR, 'services.proto.nexus.flow.common.v1.x_pb2', g)\n"
        "name = '.nexus.flow.common.v1.RunState'\n"
    )
    assert gen.rewrite_imports(gen.rewrite_imports(source)) == gen.rewrite_imports(source)


def test_generated_sources_import_through_services_proto() -> None:
    offenders = []
    root = REPO_ROOT / "services" / "proto" / "nexus"
    sources = [*root.rglob("*.py"), *root.rglob("*.pyi")]  # never bytecode caches
    for path in sorted(sources):
        for line in path.read_text().splitlines():
            stripped = line.lstrip()
            if stripped.startswith(("from nexus.", "import nexus.")):
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {stripped}")
    assert not offenders, "\n".join(offenders)


def test_namespaces_expose_messages_enums_and_grpc_entry_points() -> None:
    from services.proto import common_v1, runtime_v1

    request = runtime_v1.StartRunRequest(
        request_id="req-1",
        scope=common_v1.TrustedRuntimeWorkScope(org_id="org-1"),
        flow=runtime_v1.FlowVersionSelector(flow_api_name="Example"),
    )
    decoded = runtime_v1.StartRunRequest.FromString(request.SerializeToString())
    assert decoded.scope.org_id == "org-1"
    assert decoded.WhichOneof("target") == "flow"
    assert common_v1.RunState.Value("RUN_STATE_UNSPECIFIED") == 0
    assert callable(runtime_v1.add_FlowRunServiceServicer_to_server)
    assert runtime_v1.FlowRunServiceStub is not None


def test_services_proto_exports_exactly_the_four_namespaces() -> None:
    import services.proto as proto

    assert sorted(proto.__all__) == list(NAMESPACES)
    for name in NAMESPACES:
        assert isinstance(getattr(proto, name), ModuleType)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_each_namespace_reexports_its_whole_package(namespace: str) -> None:
    module = getattr(importlib.import_module("services.proto"), namespace)
    package = f"nexus.flow.{namespace.removesuffix('_v1')}.v1"
    package_dir = REPO_ROOT / "services" / "proto" / Path(*package.split("."))
    expected: set[str] = set()
    services: set[str] = set()
    for source in sorted(package_dir.glob("*_pb2.py")):
        pb2 = importlib.import_module(f"services.proto.{package}.{source.stem}")
        file_descriptor = pb2.DESCRIPTOR
        assert file_descriptor.package == package
        expected |= set(file_descriptor.message_types_by_name)
        expected |= set(file_descriptor.enum_types_by_name)
        for service in file_descriptor.services_by_name:
            services.add(f"{package}.{service}")
            expected |= {f"{service}Servicer", f"{service}Stub"}
            expected.add(f"add_{service}Servicer_to_server")
    if services:
        expected.add("SERVICE_NAMES")
        assert set(module.SERVICE_NAMES) == services
    assert expected, f"nothing generated for {package}"
    assert set(module.__all__) == expected
    assert list(module.__all__) == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


async def test_base_servicer_answers_unimplemented_over_grpc() -> None:
    from services.proto import common_v1, runtime_v1

    server = grpc.aio.server()
    # The stubs mark servicer methods abstract; the runtime base class answers UNIMPLEMENTED,
    # which is exactly what this test pins.
    servicer = runtime_v1.FlowRunServiceServicer()  # type: ignore[abstract]
    runtime_v1.add_FlowRunServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = runtime_v1.FlowRunServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetRun(
                    runtime_v1.GetRunRequest(org_id="org-1", flow_run_id="run-1"), timeout=10
                )
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert common_v1.ErrorDetail(code="x", retryable=True).retryable
    finally:
        await server.stop(None)
