"""Prepare a running stack for the grpcurl cookbook and write ``<data dir>/grpcurl.md``.

Called by ``make run`` after the demo is seeded (see :mod:`flowctl.cookbook` for what is
prepared and why). Uses only the public gRPC APIs, like the demo seeding.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format

from flowctl.catalog import build_catalog, parse_build_document
from flowctl.common import channel_for
from flowctl.cookbook import COOKBOOK_FLOW, START_INPUT, Ids, new_nonce, render
from flowctl.cookbook_calls import HANDOFF_PAYLOAD
from flowctl.demo import DEMO_CATALOG, DemoSummary, local_target, start_waiting_run
from runtime_svc.outbox import PAYLOAD_SCHEMA_VERSION, EffectSubmitIntent, effect_submit_intent
from services.auth import (
    HANDOFF_SUBMIT_ROLE,
    OPERATOR_ROLES,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    load_signing_key,
    mint_credential,
)
from services.config import ServiceConfig, ServiceName
from services.effect_contract import FLOW_EFFECT_SUBMIT_FAMILY, FLOW_EFFECT_SUBMIT_FAMILY_VERSION
from services.invariants import InvariantError
from services.proto import catalog_v1, common_v1, effect_v1, runtime_v1

__all__ = ["COOKBOOK_FILE", "write_cookbook"]

COOKBOOK_FILE = "grpcurl.md"
CB_INST, CB_CAP = "inst-cookbook", "cap-cookbook"
_TOKEN_TTL_S = 12 * 3600
_TIMEOUT_S = 30.0
#: The owner kind of the cookbook's handoff and the plan step it pretends to come from.
_HANDOFF_KIND, _HANDOFF_STEP = "email.smtp", "send_welcome"
#: How long the set-up waits for the owner to send the handed-over e-mail (polls, s).
_RECEIPT_POLLS, _RECEIPT_POLL_S = 240, 0.25
#: A diagnostic-retention reference names how long it holds; the page releases it anyway.
_RETAIN_UNTIL = "2099-01-01T00:00:00Z"


def _doc(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


class _Tokens:
    """Mints credentials with one signing key: by default the operator's (the configured
    ``FLOW_AUTH_SIGNING_KEY``, every audience, the operator roles)."""

    def __init__(
        self,
        key_path: Path,
        key_id: str,
        *,
        subject: str = "grpcurl-cookbook",
        audiences: Sequence[ServiceName] = tuple(ServiceName),
        roles: Sequence[str] = OPERATOR_ROLES,
    ) -> None:
        self._key = load_signing_key(key_path)
        self._key_id = key_id
        self._subject, self._audiences, self._roles = subject, tuple(audiences), tuple(roles)

    def token(self, org: str, inst: str, cap: str, digest: str | None, ttl: int = 300) -> str:
        claims = WorkloadClaims(
            subject=self._subject,
            audiences=self._audiences,
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            runtime_work_binding_digest=digest,
            roles=self._roles,
        )
        return mint_credential(self._key, self._key_id, claims, ttl_s=ttl)

    def md(self, org: str, inst: str, cap: str, digest: str | None) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token(org, inst, cap, digest)}"),)


def _runtime_identity(runtime_cfg: ServiceConfig) -> _Tokens:
    """The runtime's own identity: its service key, audience effect-owner, the handoff role
    (what its outbox dispatcher signs AcceptHandoff/RejectIfUnaccepted with)."""
    return _Tokens(
        runtime_cfg.auth_service_key,
        runtime_cfg.auth_service_key_id,
        subject=ServiceName.RUNTIME.value,
        audiences=(ServiceName.EFFECT_OWNER,),
        roles=(HANDOFF_SUBMIT_ROLE,),
    )


def _cookbook_plan(org: str) -> Any:
    """The demo catalog cut down to one entry, for the second work scope."""
    doc = yaml.safe_load(DEMO_CATALOG.read_text(encoding="utf-8"))
    doc.update(org_id=org, app_installation_id=CB_INST, runtime_capability_id=CB_CAP)
    doc["metadata_view"] = {
        "schema_generation": 1,
        "objects": [
            {
                "api_name": "Note",
                "fields": [{"api_name": "Body", "type": "text", "max_length": 500}],
            }
        ],
    }
    doc["entries"] = [e for e in doc["entries"] if e["action_type"] == "core.format_name"]
    return parse_build_document(doc)


def _catalog_side(
    catalog_cfg: ServiceConfig, tokens: _Tokens, org: str, nonce: str
) -> tuple[dict[str, str], dict[str, Any]]:
    plan = _cookbook_plan(org)

    def creds(o: str, i: str | None, c: str | None, d: str | None) -> Any:
        return tokens.md(o, i or CB_INST, c or CB_CAP, d)

    with channel_for(local_target(catalog_cfg)) as channel:
        stub = catalog_v1.CatalogServiceStub(channel)
        kwargs = dict(org_id=org, app_installation_id=CB_INST, runtime_capability_id=CB_CAP)
        twin = build_catalog(channel, plan, credentials=creds, seal=True, **kwargs)
        opened = build_catalog(channel, plan, credentials=creds, seal=False, **kwargs)
        digest = twin.binding_digest
        scope = common_v1.TrustedRuntimeWorkScope(
            org_id=org,
            app_installation_id=CB_INST,
            runtime_capability_id=CB_CAP,
            runtime_work_binding_digest=digest,
        )
        md = creds(org, CB_INST, CB_CAP, digest)
        binding = stub.GetWorkBinding(
            catalog_v1.GetWorkBindingRequest(scope=scope), metadata=md, timeout=_TIMEOUT_S
        ).work_binding.binding
        stub.DeleteGeneration(
            catalog_v1.DeleteGenerationRequest(
                request_id=uuid.uuid4().hex,
                scope=scope,
                catalog_generation_id=twin.generation.catalog_generation_id,
                catalog_digest=twin.generation.catalog_digest,
            ),
            metadata=md,
            timeout=_TIMEOUT_S,
        )
    generation = opened.generation.catalog_generation_id
    catalog_digest = twin.generation.catalog_digest
    entry = twin.entries[0]
    view = catalog_v1.MetadataView()
    if plan.view is None:
        raise InvariantError("the cookbook catalog plan has no metadata view")
    view.CopyFrom(plan.view)
    view.org_id, view.app_installation_id = org, CB_INST
    submit = catalog_v1.SubmitEntryRequest()
    submit.CopyFrom(plan.entries[0])
    submit.request_id = f"cb-entry-{nonce}"
    submit.scope.CopyFrom(scope)
    submit.catalog_generation_id = generation
    values = {
        "cb_binding": digest,
        "cb_view_digest": binding.runtime_metadata_view_digest,
        "cb_generation": generation,
        "cb_catalog_digest": catalog_digest,
        "cb_entry_digest": entry.entry_digest,
        "cb_fingerprint": entry.binding_fingerprint,
    }
    documents = {
        "cb_view_json": _doc(view),
        "cb_binding_json": _doc(binding),
        "cb_entry_json": _doc(submit),
        "cb_reference_json": {
            "catalog_generation": {
                "catalog_generation_id": generation,
                "catalog_digest": catalog_digest,
            },
            "holder_kind": "REFERENCE_HOLDER_KIND_DIAGNOSTIC_RETENTION",
            "holder_id": f"cookbook-{nonce}",
            "retain_until": _RETAIN_UNTIL,
        },
        "cb_tuples_json": [
            {
                "runtime_work_binding_digest": digest,
                "catalog_generation_id": generation,
                "action_type": entry.action_type,
                "handler_ref": "python:nexus.platform.text:format_name",
                "entry_digest": entry.entry_digest,
                "binding_fingerprint": entry.binding_fingerprint,
            }
        ],
    }
    return values, documents


def _runtime_side(
    runtime_cfg: ServiceConfig, tokens: _Tokens, demo: DemoSummary, nonce: str
) -> dict[str, str]:
    org, inst, cap, digest = (
        demo.org_id,
        demo.app_installation_id,
        demo.runtime_capability_id,
        demo.binding_digest,
    )
    md = tokens.md(org, inst, cap, digest)
    # A runtime without workers (a worker process executes its runs) cannot park the run.
    park = runtime_cfg.runtime_workers > 0
    scope = common_v1.TrustedRuntimeWorkScope(
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
        runtime_work_binding_digest=digest,
    )
    with channel_for(local_target(runtime_cfg)) as channel:
        defs = runtime_v1.FlowDefinitionServiceStub(channel)
        runs = runtime_v1.FlowRunServiceStub(channel)
        version = defs.RegisterFlowVersion(
            runtime_v1.RegisterFlowVersionRequest(
                request_id=uuid.uuid4().hex,
                org_id=org,
                flow_api_name=str(COOKBOOK_FLOW["api_name"]),
                source_json=json.dumps(COOKBOOK_FLOW, indent=2),
            ),
            metadata=md,
            timeout=_TIMEOUT_S,
        ).flow_version
        compiled = defs.CompileFlowVersion(
            runtime_v1.CompileFlowVersionRequest(
                request_id=uuid.uuid4().hex,
                scope=scope,
                flow_version_id=version.flow_version_id,
                catalog_generation_id=demo.catalog_generation_id,
                catalog_digest=demo.catalog_digest,
            ),
            metadata=md,
            timeout=_TIMEOUT_S * 2,
        )
        if not compiled.compiled:
            raise RuntimeError(f"CookbookPing did not compile: {list(compiled.diagnostics)}")
        plan = compiled.plan
        defs.ActivateFlowVersion(
            runtime_v1.ActivateFlowVersionRequest(
                request_id=uuid.uuid4().hex,
                scope=scope,
                flow_version_id=version.flow_version_id,
                plan_id=plan.plan_id,
                plan_digest=plan.plan_digest,
            ),
            metadata=md,
            timeout=_TIMEOUT_S,
        )
        request = runtime_v1.StartRunRequest(
            request_id=uuid.uuid4().hex,
            scope=scope,
            idempotency_key=f"cb-{nonce}",
            flow=runtime_v1.FlowVersionSelector(flow_api_name=str(COOKBOOK_FLOW["api_name"])),
            input_json=START_INPUT,
        )
        request.wait_budget.FromSeconds(10)
        run = runs.StartRun(request, metadata=md, timeout=_TIMEOUT_S).run
        # Parked on its durable wait; the page's SubmitWakeSignal approves it.
        approval = start_waiting_run(channel, md, request=f"cookbook-{nonce}", park=park)
        # Leave the demo with exactly its own active Flows; the page re-activates it.
        defs.DeactivateFlowVersion(
            runtime_v1.DeactivateFlowVersionRequest(
                request_id=uuid.uuid4().hex, org_id=org, flow_version_id=version.flow_version_id
            ),
            metadata=md,
            timeout=_TIMEOUT_S,
        )
    return {
        "flow_version": version.flow_version_id,
        "plan": plan.plan_id,
        "plan_digest": plan.plan_digest,
        "run": run.flow_run_id,
        "checkpoint": run.current_checkpoint_id,
        "approval_run": approval.flow_run_id,
    }


def _handoff(scope: TrustedRuntimeWorkScope, run: str, ordinal: int) -> EffectSubmitIntent:
    """The deterministic handoff of one (pretended) EffectSubmit invocation."""
    return effect_submit_intent(
        scope,
        flow_run_id=run,
        submit_step_key=_HANDOFF_STEP,
        invocation_ordinal=ordinal,
        step_execution_id=f"step_{run}_{ordinal}",
        submission_attempt_id=f"att_{run}_{ordinal}",
        effect_owner_kind=_HANDOFF_KIND,
        payload=HANDOFF_PAYLOAD,
        deadline=None,
        failure_policy="fault_path",
    )


def _envelope(intent: EffectSubmitIntent) -> Any:
    """The ``RuntimeOutboxEnvelope`` the runtime's dispatcher sends for ``intent``
    (``runtime_svc.outbox.handoff.envelope_of`` of its persisted row)."""
    return common_v1.RuntimeOutboxEnvelope(
        org_id=intent.org_id,
        app_installation_id=intent.app_installation_id,
        runtime_capability_id=intent.runtime_capability_id,
        runtime_work_binding_digest=intent.runtime_work_binding_digest,
        runtime_outbox_message_id=intent.message_id,
        message_family=FLOW_EFFECT_SUBMIT_FAMILY,
        message_family_version=FLOW_EFFECT_SUBMIT_FAMILY_VERSION,
        effect_handoff_key=intent.handoff_key,
        effect_owner_kind=intent.effect_owner_kind,
        payload_schema_version=PAYLOAD_SCHEMA_VERSION,
        payload_digest=intent.payload_digest,
        payload_json=intent.payload_json,
        flow_run_id=intent.flow_run_id,
        step_execution_id=intent.step_execution_id,
        submission_attempt_id=intent.submission_attempt_id,
        failure_policy=common_v1.ExpiryPolicy.EXPIRY_POLICY_FAULT_PATH,
    )


def _effect_side(
    configs: Mapping[ServiceName, ServiceConfig], tokens: _Tokens, demo: DemoSummary, nonce: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """Hand one effect over as the runtime does and wait for the owner's receipt; the
    identities of a second handoff that is never delivered (for RejectIfUnaccepted).

    Raises:
        RuntimeError: the owner recorded no receipt in time (the page's GetReceipt would
            not find it).
    """
    org, inst, cap, digest = (
        demo.org_id,
        demo.app_installation_id,
        demo.runtime_capability_id,
        demo.binding_digest,
    )
    scope = TrustedRuntimeWorkScope(org, inst, cap, digest)
    scope_proto = common_v1.TrustedRuntimeWorkScope(
        org_id=org,
        app_installation_id=inst,
        runtime_capability_id=cap,
        runtime_work_binding_digest=digest,
    )
    run = f"cookbook-{nonce}"
    sent, unsent = _handoff(scope, run, 0), _handoff(scope, run, 1)
    envelope = _envelope(sent)
    runtime_md = _runtime_identity(configs[ServiceName.RUNTIME]).md(org, inst, cap, digest)
    with channel_for(local_target(configs[ServiceName.EFFECT_OWNER])) as channel:
        owner = effect_v1.EffectOwnerServiceStub(channel)
        command = owner.AcceptHandoff(
            effect_v1.AcceptHandoffRequest(
                request_id=uuid.uuid4().hex, scope=scope_proto, envelope=envelope
            ),
            metadata=runtime_md,
            timeout=_TIMEOUT_S,
        ).command
        read_md = tokens.md(org, inst, cap, digest)
        for _ in range(_RECEIPT_POLLS):
            try:
                owner.GetReceipt(
                    effect_v1.GetReceiptRequest(scope=scope_proto, command_id=command.command_id),
                    metadata=read_md,
                    timeout=_TIMEOUT_S,
                )
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            time.sleep(_RECEIPT_POLL_S)
        else:
            raise RuntimeError(
                f"the effect owner recorded no receipt of command {command.command_id} within "
                f"{_RECEIPT_POLLS * _RECEIPT_POLL_S:.0f} s (is its dispatcher running?)"
            )
    values = {
        "handoff_key": sent.handoff_key,
        "command": command.command_id,
        "unsent_key": unsent.handoff_key,
        "unsent_payload_digest": unsent.payload_digest,
        "unsent_message_id": unsent.message_id,
    }
    return values, {"handoff_json": _doc(envelope)}


def write_cookbook(
    configs: Mapping[ServiceName, ServiceConfig], data_dir: Path, demo: DemoSummary
) -> Path:
    """Prepare the stack and write ``<data_dir>/grpcurl.md`` plus its three token files."""
    nonce = new_nonce()
    runtime_cfg = configs[ServiceName.RUNTIME]
    tokens = _Tokens(runtime_cfg.auth_signing_key, runtime_cfg.auth_signing_key_id)
    values = {
        "org": demo.org_id,
        "inst": demo.app_installation_id,
        "cap": demo.runtime_capability_id,
        "binding": demo.binding_digest,
        "generation": demo.catalog_generation_id,
        "catalog_digest": demo.catalog_digest,
        "cb_inst": CB_INST,
        "cb_cap": CB_CAP,
        "record": f"contact-cookbook-{nonce}",
        "nonce": nonce,
        "catalog_target": local_target(configs[ServiceName.CATALOG]),
        "runtime_target": local_target(configs[ServiceName.RUNTIME]),
        "effect_target": local_target(configs[ServiceName.EFFECT_OWNER]),
        "token_dir": str(data_dir.resolve()),
        "bin_dir": str(Path(sys.executable).parent),
    }
    cb_values, documents = _catalog_side(configs[ServiceName.CATALOG], tokens, demo.org_id, nonce)
    values.update(cb_values)
    values.update(_runtime_side(runtime_cfg, tokens, demo, nonce))
    effect_values, effect_documents = _effect_side(configs, tokens, demo, nonce)
    values.update(effect_values)
    documents.update(effect_documents)
    demo_scope = (demo.app_installation_id, demo.runtime_capability_id, demo.binding_digest)
    for name, (minter, (inst, cap, digest)) in {
        "cookbook-demo.token": (tokens, demo_scope),
        "cookbook-scope.token": (tokens, (CB_INST, CB_CAP, values["cb_binding"])),
        "cookbook-runtime.token": (_runtime_identity(runtime_cfg), demo_scope),
    }.items():
        path = data_dir / name
        path.write_text(
            minter.token(demo.org_id, inst, cap, digest, ttl=_TOKEN_TTL_S) + "\n",
            encoding="utf-8",
        )
        path.chmod(0o600)
    page = data_dir / COOKBOOK_FILE
    page.write_text(render(Ids(values, documents), filled=True), encoding="utf-8")
    return page
