"""The ``make run`` demo: a sealed catalog generation and two ACTIVE Flows, via public APIs.

:func:`seed` talks to the running services over gRPC only (the same calls ``flowctl
catalog build --seal``, ``flowctl flow register`` and ``flowctl flow activate`` make):

1. builds and seals the demo catalog from ``examples/catalog/demo.yaml`` with
   :func:`flowctl.catalog.build_catalog` (publish the metadata view, register the work
   binding, open a generation, submit the entries, seal);
2. registers the demo Flows (``examples/flows/``, :data:`DEMO_FLOWS`);
3. compiles each against the sealed generation and activates the plan it yields;
4. starts one :data:`WAITING_FLOW` run and waits until it is parked on its durable wait;
   the banner prints the ``flowctl signal send`` command that wakes it (every start of
   the stack parks a new one: a signal is consumed once).

Restarting ``make run`` on the same ``./.data`` is idempotent:

* the view and the binding are content-addressed, so re-publishing them returns the
  same digests, and re-registering an unchanged Flow version returns the stored one;
* a catalog generation has an id of its own, but its ``CatalogDigest`` is content
  identity (binding digest + entry digests). When the demo Flows are already ACTIVE on a
  sealed generation of the same binding with the same digest, that generation is
  **reused** and the one just built is deleted (nothing references it yet). Compiling
  against the reused generation yields the identical plan (insert-if-absent on the plan
  identity tuple), and activating an identical plan is a no-op, so generation id, plan
  ids and activations stay the same across restarts;
* when the catalog content changed (or nothing is active yet), the new generation is
  kept and activation supersedes the previous plan of each Flow.

Editing a demo Flow without bumping its ``version`` is refused by the runtime (a Flow
version is immutable); the seeding error says so.

The result, :class:`DemoSummary`, is also written to ``<data dir>/demo.json`` so scripts
can find the scope, generation and plans without parsing the banner.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf.struct_pb2 import Struct

from flowctl.catalog import BuildResult, build_catalog, parse_build_document
from flowctl.common import CliError, channel_for
from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ConfigError, ServiceConfig, ServiceName
from services.proto import catalog_v1, common_v1, runtime_v1

__all__ = [
    "DEMO_CATALOG",
    "DEMO_FLOWS",
    "SUMMARY_FILE",
    "WELCOME_FLOW",
    "DemoFlow",
    "DemoSeedError",
    "DemoSummary",
    "WaitingRun",
    "local_target",
    "seed",
    "start_waiting_run",
]

_log = logging.getLogger("devstack.demo")

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The demo catalog build document.
DEMO_CATALOG = _EXAMPLES / "catalog" / "demo.yaml"
#: The demo Flows, in the order they are registered and activated.
DEMO_FLOWS = (
    _EXAMPLES / "flows" / "normalize_contact_name.json",
    _EXAMPLES / "flows" / "welcome_contact.json",
    _EXAMPLES / "flows" / "await_approval.json",
)
#: The demo Flow a new Contact starts (its e-mail is the demo's external effect).
WELCOME_FLOW = "WelcomeContact"
#: The demo Flow a waiting run is started for; the banner prints the signal that wakes it.
WAITING_FLOW = "AwaitApproval"
#: The signal kind and evidence that approve it (``examples/flows/await_approval.json``).
APPROVAL_KIND = "external.signal"
APPROVAL_EVIDENCE = '{"status": "approved"}'
#: The file in the data dir that receives :meth:`DemoSummary.to_dict` as JSON.
SUMMARY_FILE = "demo.json"

_CALL_TIMEOUT_S = 30.0
#: How long seeding waits for the demo run to park on its wait (polls, interval).
_WAIT_POLLS, _WAIT_POLL_S = 150, 0.2
_MOVING = frozenset(
    {
        common_v1.RunState.RUN_STATE_ACCEPTED,
        common_v1.RunState.RUN_STATE_RUNNABLE,
        common_v1.RunState.RUN_STATE_RUNNING,
    }
)
_COMPILE_TIMEOUT_S = 60.0
_MAX_PAGES = 100
_TOKEN_TTL_S = 300
_ACTIVE = runtime_v1.ActivationState.ACTIVATION_STATE_ACTIVE

Metadata = Sequence[tuple[str, str]]


class DemoSeedError(Exception):
    """Seeding the demo failed; the message names the step and the server's answer."""


@dataclass(frozen=True)
class DemoFlow:
    """One demo Flow and the plan it is ACTIVE on."""

    flow_api_name: str
    flow_version_id: str
    plan_id: str
    plan_digest: str
    profile: str  # e.g. ``embedded_before_save``
    state: str  # e.g. ``active``


@dataclass(frozen=True)
class WaitingRun:
    """The demo run waiting for an approval signal, and the signal that wakes it."""

    flow_run_id: str
    state: str  # e.g. ``waiting``
    producer_kind: str
    producer_key: str
    wake_token: str
    evidence_json: str


@dataclass(frozen=True)
class DemoSummary:
    """What :func:`seed` left in the services."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    binding_digest: str
    catalog_generation_id: str
    catalog_digest: str
    generation_reused: bool
    flows: tuple[DemoFlow, ...]
    waiting_run: WaitingRun | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_target(cfg: ServiceConfig) -> str:
    """``host:port`` at which a locally started service is reached."""
    host = cfg.listen_host
    if host in ("", "0.0.0.0", "::", "[::]"):  # a wildcard bind is dialled on loopback
        host = "127.0.0.1"
    return f"{host}:{cfg.port}"


def _profile_name(value: common_v1.ExecutionProfile.ValueType) -> str:
    return common_v1.ExecutionProfile.Name(value).removeprefix("EXECUTION_PROFILE_").lower()


def _request_id() -> str:
    return f"demo-{uuid.uuid4().hex}"


def _rpc_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"


class _Minter:
    """Short-lived credentials for the demo's calls, signed with the configured dev key."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self._key = load_signing_key(cfg.auth_signing_key)
        self._key_id = cfg.auth_signing_key_id

    def __call__(
        self,
        audience: ServiceName,
        org: str,
        inst: str | None = None,
        cap: str | None = None,
        digest: str | None = None,
    ) -> Metadata:
        claims = WorkloadClaims(
            subject="devstack-demo",
            audiences=(audience,),
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            runtime_work_binding_digest=digest,
        )
        token = mint_credential(self._key, self._key_id, claims, ttl_s=_TOKEN_TTL_S)
        return (("authorization", f"Bearer {token}"),)


@contextmanager
def _step(what: str) -> Iterator[None]:
    """Turn the failure of one seeding step into a :class:`DemoSeedError` naming it."""
    try:
        yield
    except grpc.RpcError as exc:
        raise DemoSeedError(f"{what}: {_rpc_text(exc)}") from exc
    except (CliError, ConfigError, OSError, ValueError, yaml.YAMLError) as exc:
        raise DemoSeedError(f"{what}: {exc}") from exc


@dataclass(frozen=True)
class _FlowFile:
    path: Path
    api_name: str
    source: str

    @classmethod
    def read(cls, path: Path) -> _FlowFile:
        source = path.read_text(encoding="utf-8")
        doc = json.loads(source)
        if not isinstance(doc, dict) or not isinstance(doc.get("api_name"), str):
            raise ValueError("not a Flow document (no api_name)")
        return cls(path, doc["api_name"], source)


def _active_demo_plans(
    stub: Any, md: Metadata, names: Sequence[str]
) -> Iterator[runtime_v1.FlowActivation]:
    """The ACTIVE activations of the named Flows (any installation; caller filters)."""
    for name in names:
        token = ""
        for _ in range(_MAX_PAGES):
            resp = stub.ListFlowVersions(
                runtime_v1.ListFlowVersionsRequest(flow_api_name=name, page_token=token),
                metadata=md,
                timeout=_CALL_TIMEOUT_S,
            )
            yield from (
                a for a in resp.activations if a.flow_api_name == name and a.state == _ACTIVE
            )
            token = resp.next_page_token
            if not token:
                break


def _reusable_generation(
    runtime: Any, md: Metadata, names: Sequence[str], built: BuildResult
) -> str | None:
    """A sealed generation an ACTIVE demo plan uses with the just-built content, if any.

    Same binding digest + same catalog digest means the same binding and the same sealed
    entries (``CatalogDigest`` commits to both), so it is interchangeable with ``built``.
    The activation holds retention references on it, so it cannot have been deleted.
    """
    for act in _active_demo_plans(runtime, md, names):
        if act.runtime_work_binding_digest != built.binding_digest:
            continue
        plan = runtime.GetPlan(
            runtime_v1.GetPlanRequest(plan_id=act.plan_id), metadata=md, timeout=_CALL_TIMEOUT_S
        ).plan
        if (
            plan.catalog_digest == built.generation.catalog_digest
            and plan.catalog_generation_id != built.generation.catalog_generation_id
        ):
            return str(plan.catalog_generation_id)
    return None


def _diagnostics_text(diagnostics: Sequence[Any]) -> str:
    lines = []
    for d in diagnostics:
        sev = runtime_v1.DiagnosticSeverity.Name(d.severity).removeprefix("DIAGNOSTIC_SEVERITY_")
        chain = f" (blocker: {' → '.join(d.blocker_chain)})" if d.blocker_chain else ""
        lines.append(f"  {sev.lower()} {d.path}: [{d.code}] {d.message}{chain}")
    return "\n".join(lines)


def _activate_flow(
    runtime: Any,
    org_md: Metadata,
    scoped_md: Metadata,
    scope: common_v1.TrustedRuntimeWorkScope,
    flow: _FlowFile,
    generation_id: str,
    catalog_digest: str,
) -> DemoFlow:
    name = flow.api_name
    with _step(f"registering {name} ({flow.path.name})"):
        version = runtime.RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(
                request_id=_request_id(), flow_api_name=name, source_json=flow.source
            ),
            metadata=org_md,
            timeout=_CALL_TIMEOUT_S,
        ).flow_version
    with _step(f"compiling {name}"):
        compiled = runtime.CompileFlowVersion(
            runtime_v1.CompileFlowVersionRequest(
                request_id=_request_id(),
                scope=scope,
                flow_version_id=version.flow_version_id,
                catalog_generation_id=generation_id,
                catalog_digest=catalog_digest,
            ),
            metadata=scoped_md,
            timeout=_COMPILE_TIMEOUT_S,
        )
    if not compiled.compiled:
        raise DemoSeedError(
            f"compiling {name} against {generation_id} was rejected:\n"
            + _diagnostics_text(compiled.diagnostics)
        )
    with _step(f"activating {name}"):
        activation = runtime.ActivateFlowVersion(
            runtime_v1.ActivateFlowVersionRequest(
                request_id=_request_id(),
                scope=scope,
                flow_version_id=version.flow_version_id,
                plan_id=compiled.plan.plan_id,
                plan_digest=compiled.plan.plan_digest,
            ),
            metadata=scoped_md,
            timeout=_COMPILE_TIMEOUT_S,
        ).activation
    state = runtime_v1.ActivationState.Name(activation.state).removeprefix("ACTIVATION_STATE_")
    return DemoFlow(
        flow_api_name=name,
        flow_version_id=version.flow_version_id,
        plan_id=activation.plan_id,
        plan_digest=activation.plan_digest,
        profile=_profile_name(compiled.plan.execution_profile),
        state=state.lower(),
    )


def start_waiting_run(
    runtime_channel: grpc.Channel,
    md: Metadata,
    request: str | None = None,
    *,
    park: bool = True,
) -> WaitingRun:
    """Start an :data:`WAITING_FLOW` run for the approval ``request`` (its idempotency key;
    by default a fresh ``demo-…`` each start) and, with ``park``, wait (bounded) until it
    is parked on its durable wait or has moved on. Without ``park`` — the runtime process
    runs no workers (``FLOW_RUNTIME_WORKERS=0``; a worker process will execute it) — the
    run is returned as accepted. Returns the signal that approves it.

    Raises:
        DemoSeedError: a call failed.
    """
    request = request or f"demo-{uuid.uuid4().hex[:8]}"
    runs = runtime_v1.FlowRunServiceStub(runtime_channel)
    with _step(f"starting a {WAITING_FLOW} run"):
        inputs = Struct()
        inputs.update({"requestId": request, "subject": "demo purchase order"})
        run = runs.StartRun(
            runtime_v1.StartRunRequest(
                request_id=_request_id(),
                flow=runtime_v1.FlowVersionSelector(flow_api_name=WAITING_FLOW),
                input_variables=inputs,
                idempotency_key=request,
            ),
            metadata=md,
            timeout=_CALL_TIMEOUT_S,
        ).run
    waiting = common_v1.RunState.RUN_STATE_WAITING
    with _step(f"waiting for the {WAITING_FLOW} run to reach its wait"):
        for _ in range(_WAIT_POLLS if park else 0):
            if run.runtime_state not in _MOVING:
                break
            time.sleep(_WAIT_POLL_S)
            run = runs.GetRun(
                runtime_v1.GetRunRequest(flow_run_id=run.flow_run_id),
                metadata=md,
                timeout=_CALL_TIMEOUT_S,
            ).run
    if run.runtime_state != waiting and park:
        _log.warning("the demo %s run is %s, not waiting", WAITING_FLOW, run.runtime_state)
    state = common_v1.RunState.Name(run.runtime_state).removeprefix("RUN_STATE_").lower()
    return WaitingRun(
        flow_run_id=run.flow_run_id,
        state=state,
        producer_kind=APPROVAL_KIND,
        producer_key=f"approval:{request}",
        wake_token=f"approve-{request}",
        evidence_json=APPROVAL_EVIDENCE,
    )


def seed(
    configs: Mapping[ServiceName, ServiceConfig],
    data_dir: Path,
    *,
    catalog_file: Path = DEMO_CATALOG,
    flow_files: Sequence[Path] = DEMO_FLOWS,
) -> DemoSummary:
    """Build the demo catalog and activate the demo Flows (module docstring); idempotent.

    Args:
        configs: the configuration of each running service (ports, signing key).
        data_dir: where ``demo.json`` (the returned summary) is written.
        catalog_file: catalog build document (``flowctl catalog build`` format).
        flow_files: Flow documents (JSON) to register, compile and activate, in order.

    Raises:
        DemoSeedError: a step failed; the message names it and the server's answer.
    """
    with _step("loading the demo"):
        plan = parse_build_document(yaml.safe_load(catalog_file.read_text(encoding="utf-8")))
        mint = _Minter(configs[ServiceName.CATALOG])
    org, inst, cap = plan.org_id, plan.app_installation_id, plan.runtime_capability_id
    if not (org and inst and cap):
        raise DemoSeedError(
            f"{catalog_file}: org_id, app_installation_id and runtime_capability_id are required"
        )
    flows: list[_FlowFile] = []
    for path in flow_files:
        with _step(f"reading {path}"):
            flows.append(_FlowFile.read(path))
    names = [f.api_name for f in flows]

    with (
        channel_for(local_target(configs[ServiceName.CATALOG])) as catalog_channel,
        channel_for(local_target(configs[ServiceName.RUNTIME])) as runtime_channel,
    ):
        catalog = catalog_v1.CatalogServiceStub(catalog_channel)
        runtime = runtime_v1.FlowDefinitionServiceStub(runtime_channel)

        with _step(f"building the catalog from {catalog_file.name}"):
            built = build_catalog(
                catalog_channel,
                plan,
                org_id=org,
                app_installation_id=inst,
                runtime_capability_id=cap,
                credentials=lambda o, i, c, d: mint(ServiceName.CATALOG, o, i, c, d),
                seal=True,
            )
        digest = built.binding_digest
        scope = common_v1.TrustedRuntimeWorkScope(
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            runtime_work_binding_digest=digest,
        )
        catalog_md = mint(ServiceName.CATALOG, org, inst, cap, digest)
        org_md = mint(ServiceName.RUNTIME, org)
        scoped_md = mint(ServiceName.RUNTIME, org, inst, cap, digest)
        generation_id = built.generation.catalog_generation_id
        catalog_digest = built.generation.catalog_digest

        with _step("looking for the generation the demo Flows already use"):
            reuse = _reusable_generation(runtime, org_md, names, built)
        if reuse is not None:
            # Identical content: keep the generation the active plans pin, drop the new one.
            try:
                catalog.DeleteGeneration(
                    catalog_v1.DeleteGenerationRequest(
                        request_id=_request_id(),
                        scope=scope,
                        catalog_generation_id=generation_id,
                        catalog_digest=catalog_digest,
                    ),
                    metadata=catalog_md,
                    timeout=_CALL_TIMEOUT_S,
                )
            except grpc.RpcError as exc:  # an unused extra generation is harmless
                _log.warning(
                    "could not delete duplicate generation %s: %s", generation_id, _rpc_text(exc)
                )
            _log.info("catalog unchanged: reusing generation %s", reuse)
            generation_id = reuse
        else:
            _log.info("catalog generation %s sealed (%s)", generation_id, catalog_digest)

        activated = tuple(
            _activate_flow(runtime, org_md, scoped_md, scope, f, generation_id, catalog_digest)
            for f in flows
        )
        park = configs[ServiceName.RUNTIME].runtime_workers > 0
        waiting = (
            start_waiting_run(runtime_channel, scoped_md, park=park)
            if WAITING_FLOW in names
            else None
        )
    summary = DemoSummary(
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
        binding_digest=digest,
        catalog_generation_id=generation_id,
        catalog_digest=catalog_digest,
        generation_reused=reuse is not None,
        flows=activated,
        waiting_run=waiting,
    )
    with _step(f"writing {data_dir / SUMMARY_FILE}"):
        (data_dir / SUMMARY_FILE).write_text(
            json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8"
        )
    return summary
