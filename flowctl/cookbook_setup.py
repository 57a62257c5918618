"""Prepare a running stack for the grpcurl cookbook and write ``<data dir>/grpcurl.md``.

Called by ``make run`` after the demo is seeded (see :mod:`flowctl.cookbook` for what is
prepared and why). Uses only the public gRPC APIs, like the demo seeding.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from flowctl.catalog import build_catalog, parse_build_document
from flowctl.common import channel_for
from flowctl.cookbook import COOKBOOK_FLOW, START_INPUT, Ids, new_nonce, render
from flowctl.demo import DEMO_CATALOG, DemoSummary, local_target
from services.auth import WorkloadClaims, load_signing_key, mint_credential
from services.config import ServiceConfig, ServiceName
from services.invariants import InvariantError
from services.proto import catalog_v1, common_v1, runtime_v1

__all__ = ["COOKBOOK_FILE", "write_cookbook"]

COOKBOOK_FILE = "grpcurl.md"
CB_INST, CB_CAP = "inst-cookbook", "cap-cookbook"
_TOKEN_TTL_S = 12 * 3600
_TIMEOUT_S = 30.0
_ROLES = ("flow.runs.cancel", "flow.runs.delete")
#: A diagnostic-retention reference names how long it holds; the page releases it anyway.
_RETAIN_UNTIL = "2099-01-01T00:00:00Z"


def _doc(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


class _Tokens:
    def __init__(self, cfg: ServiceConfig) -> None:
        self._key = load_signing_key(cfg.auth_signing_key)
        self._key_id = cfg.auth_signing_key_id

    def token(self, org: str, inst: str, cap: str, digest: str | None, ttl: int = 300) -> str:
        claims = WorkloadClaims(
            subject="grpcurl-cookbook",
            audiences=tuple(ServiceName),
            org_id=org,
            app_installation_id=inst,
            runtime_capability_id=cap,
            runtime_work_binding_digest=digest,
            roles=_ROLES,
        )
        return mint_credential(self._key, self._key_id, claims, ttl_s=ttl)

    def md(self, org: str, inst: str, cap: str, digest: str | None) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token(org, inst, cap, digest)}"),)


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
    }


def write_cookbook(
    configs: Mapping[ServiceName, ServiceConfig], data_dir: Path, demo: DemoSummary
) -> Path:
    """Prepare the stack and write ``<data_dir>/grpcurl.md`` plus its two token files."""
    nonce = new_nonce()
    tokens = _Tokens(configs[ServiceName.RUNTIME])
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
    values.update(_runtime_side(configs[ServiceName.RUNTIME], tokens, demo, nonce))
    for name, (inst, cap, digest) in {
        "cookbook-demo.token": (
            demo.app_installation_id,
            demo.runtime_capability_id,
            demo.binding_digest,
        ),
        "cookbook-scope.token": (CB_INST, CB_CAP, values["cb_binding"]),
    }.items():
        path = data_dir / name
        path.write_text(
            tokens.token(demo.org_id, inst, cap, digest, ttl=_TOKEN_TTL_S) + "\n", encoding="utf-8"
        )
        path.chmod(0o600)
    page = data_dir / COOKBOOK_FILE
    page.write_text(render(Ids(values, documents), filled=True), encoding="utf-8")
    return page
