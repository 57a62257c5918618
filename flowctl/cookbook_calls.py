"""The calls of the grpcurl cookbook (:mod:`flowctl.cookbook` renders them).

One :class:`Call` per RPC of the three services, in the order a person pastes them; each
carries the status it answers on the set-up stack (``expect``): ``OK``, or a documented
error with its reason. After changing a call, regenerate ``docs/grpcurl.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowctl.demo import APPROVAL_KIND as DEMO_APPROVAL_KIND
from runtime_svc.waits.evidence import evidence_digest
from services.digest import canonical_json

__all__ = [
    "APPROVAL_EVIDENCE",
    "APPROVAL_EVIDENCE_DIGEST",
    "APPROVAL_KIND",
    "CALLS",
    "COOKBOOK_FLOW",
    "DEMO_SCOPE",
    "HANDOFF_PAYLOAD",
    "RUNS",
    "START_INPUT",
    "Call",
]

CATALOG = "nexus.flow.catalog.v1.CatalogService"
DEFS = "nexus.flow.runtime.v1.FlowDefinitionService"
RUNS = "nexus.flow.runtime.v1.FlowRunService"
RECORDS = "nexus.flow.runtime.v1.RecordService"
WAKE = "nexus.flow.runtime.v1.WakeSignalService"
EFFECT = "nexus.flow.effect.v1.EffectOwnerService"


#: Autolaunched and provably safe (Bounded Atomic): StartRun returns its result.
COOKBOOK_FLOW: Mapping[str, Any] = {
    "api_name": "CookbookPing",
    "version": 1,
    "label": "grpcurl cookbook: greet",
    "process_type": "autolaunched",
    "variables": [
        {"name": "subject", "type": "string", "input": True},
        {"name": "greeting", "type": "string", "output": True},
    ],
    "start": "greet",
    "elements": [
        {
            "api_name": "greet",
            "type": "Assignment",
            "assignments": [{"target": "greeting", "value": "CONCAT('Hello ', subject)"}],
        }
    ],
}
#: The signal that approves the cookbook's AwaitApproval run (``examples/flows/
#: await_approval.json``): kind, canonical evidence and its ``wake-evidence/v1`` digest.
APPROVAL_KIND = DEMO_APPROVAL_KIND
APPROVAL_EVIDENCE = canonical_json({"status": "approved"}).decode()
APPROVAL_EVIDENCE_DIGEST = evidence_digest({"status": "approved"})
#: The safe payload of the cookbook's effect handoff (the owner's e-mail provider sends
#: it to the dev mail sink).
HANDOFF_PAYLOAD: Mapping[str, Any] = {
    "to": "grace@example.com",
    "template": "contact_welcome",
}
#: StartRun's input in the cookbook (the set-up's run uses the same, so the call
#: finds that run by its idempotency key).
START_INPUT = '{"subject": "grpcurl"}'


@dataclass(frozen=True)
class Call:
    """One documented grpcurl call.

    Attributes:
        service: full gRPC service name.
        method: RPC name.
        what: one line: what the call does; ``{name}`` strings are replaced as in ``body``.
        body: request JSON; ``{name}`` strings are replaced from the ids.
        target: ``catalog``, ``runtime`` or ``effect``.
        credential: ``DEMO_TOKEN``, ``SCOPE_TOKEN``, ``RUNTIME_TOKEN`` or ``""`` (none):
            the shell variable.
        expect: ``OK`` or the gRPC status name the call answers today.
        why: for an error, why (shown next to the call).
    """

    service: str
    method: str
    what: str
    body: Mapping[str, Any] | str | None
    target: str
    credential: str = "DEMO_TOKEN"
    expect: str = "OK"
    why: str = ""


DEMO_SCOPE = {
    "org_id": "{org}",
    "app_installation_id": "{inst}",
    "runtime_capability_id": "{cap}",
    "runtime_work_binding_digest": "{binding}",
}
CB_SCOPE = {
    "org_id": "{org}",
    "app_installation_id": "{cb_inst}",
    "runtime_capability_id": "{cb_cap}",
    "runtime_work_binding_digest": "{cb_binding}",
}

CALLS: tuple[Call, ...] = (
    # --- catalog: a second, small work scope so the writes leave the demo alone ---------
    Call(
        CATALOG,
        "PublishMetadataView",
        "publish (content-addressed, idempotent) a metadata view",
        {"request_id": "cb-view-{nonce}", "org_id": "{org}", "view": "{cb_view_json}"},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "GetMetadataView",
        "read a view by digest",
        {
            "org_id": "{org}",
            "app_installation_id": "{cb_inst}",
            "runtime_metadata_view_digest": "{cb_view_digest}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "RegisterWorkBinding",
        "register the work binding that pins the view",
        {"request_id": "cb-binding-{nonce}", "org_id": "{org}", "binding": "{cb_binding_json}"},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "GetWorkBinding",
        "read the binding of a complete work scope",
        {"scope": CB_SCOPE},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "OpenGeneration",
        "open a new (empty) capability-catalog generation",
        {"request_id": "cb-open-{nonce}", "scope": CB_SCOPE, "contract_version": 1},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "SubmitEntry",
        "submit an entry into an open generation",
        "{cb_entry_json}",
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "SealGeneration",
        "seal it: entries sorted, CatalogDigest computed",
        {
            "request_id": "cb-seal-{nonce}",
            "scope": CB_SCOPE,
            "catalog_generation_id": "{cb_generation}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "GetGeneration",
        "read a generation",
        {"scope": CB_SCOPE, "catalog_generation_id": "{cb_generation}"},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "ListEntries",
        "list a sealed generation's entries",
        {
            "scope": CB_SCOPE,
            "catalog_generation_id": "{cb_generation}",
            "catalog_digest": "{cb_catalog_digest}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "GetEntry",
        "read one entry by action type",
        {
            "scope": CB_SCOPE,
            "catalog_generation_id": "{cb_generation}",
            "catalog_digest": "{cb_catalog_digest}",
            "action_type": "core.format_name",
            "entry_digest": "{cb_entry_digest}",
            "binding_fingerprint": "{cb_fingerprint}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "RegisterReference",
        "hold the generation (retention reference)",
        {"request_id": "cb-ref-{nonce}", "scope": CB_SCOPE, "reference": "{cb_reference_json}"},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "ReleaseReference",
        "release that reference",
        {"request_id": "cb-unref-{nonce}", "scope": CB_SCOPE, "reference": "{cb_reference_json}"},
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "PublishHandlerAvailability",
        "a runtime release says which handlers it has",
        {
            "request_id": "cb-avail-{nonce}",
            "scope": CB_SCOPE,
            "runtime_release_id": "rel-cookbook",
            "supported_capability_version": 1,
            "tuples": "{cb_tuples_json}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "VerifyRuntimeBinary",
        "does that release cover the generation's handlers?",
        {
            "scope": CB_SCOPE,
            "runtime_release_id": "rel-cookbook",
            "catalog_generation_ids": ["{cb_generation}"],
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "DeleteGeneration",
        "delete an unreferenced generation",
        {
            "request_id": "cb-delete-{nonce}",
            "scope": CB_SCOPE,
            "catalog_generation_id": "{cb_generation}",
            "catalog_digest": "{cb_catalog_digest}",
        },
        "catalog",
        "SCOPE_TOKEN",
    ),
    Call(
        CATALOG,
        "DeleteMetadataView",
        "delete a view (refused while a binding pins it)",
        {
            "request_id": "cb-delview-{nonce}",
            "org_id": "{org}",
            "app_installation_id": "{cb_inst}",
            "runtime_metadata_view_digest": "{cb_view_digest}",
        },
        "catalog",
        "SCOPE_TOKEN",
        "FAILED_PRECONDITION",
        "the cookbook's binding still references the view",
    ),
    # --- runtime: definitions ------------------------------------------------------------
    Call(
        DEFS,
        "RegisterFlowVersion",
        "store an immutable Flow version (idempotent per source)",
        {
            "request_id": "cb-flow-{nonce}",
            "org_id": "{org}",
            "flow_api_name": "CookbookPing",
            "source_json": "{flow_source}",
        },
        "runtime",
    ),
    Call(
        DEFS,
        "CompileFlowVersion",
        "compile it against the demo's sealed generation",
        {
            "request_id": "cb-compile-{nonce}",
            "scope": DEMO_SCOPE,
            "flow_version_id": "{flow_version}",
            "catalog_generation_id": "{generation}",
            "catalog_digest": "{catalog_digest}",
        },
        "runtime",
    ),
    Call(
        DEFS,
        "ActivateFlowVersion",
        "activate it on that plan",
        {
            "request_id": "cb-activate-{nonce}",
            "scope": DEMO_SCOPE,
            "flow_version_id": "{flow_version}",
            "plan_id": "{plan}",
            "plan_digest": "{plan_digest}",
        },
        "runtime",
    ),
    Call(
        DEFS,
        "GetPlan",
        "read an immutable plan",
        {"org_id": "{org}", "plan_id": "{plan}"},
        "runtime",
    ),
    Call(
        DEFS,
        "ListFlowVersions",
        "Flow versions and their activations",
        {"org_id": "{org}", "flow_api_name": "CookbookPing"},
        "runtime",
    ),
    Call(
        DEFS,
        "GetInventory",
        "compile-only inventory of the active Flows (§20.4)",
        {
            "scope": DEMO_SCOPE,
            "catalog_generation_id": "{generation}",
            "catalog_digest": "{catalog_digest}",
        },
        "runtime",
    ),
    # --- runtime: runs -------------------------------------------------------------------
    Call(
        RUNS,
        "StartRun",
        "start a run (Bounded Atomic: finished within the call)",
        {
            "request_id": "cb-start-{nonce}",
            "scope": DEMO_SCOPE,
            "idempotency_key": "cb-{nonce}",
            "flow": {"flow_api_name": "CookbookPing"},
            "input_json": START_INPUT,
            "wait_budget": "10s",
        },
        "runtime",
    ),
    Call(RUNS, "GetRun", "read a run", {"org_id": "{org}", "flow_run_id": "{run}"}, "runtime"),
    Call(
        RUNS,
        "GetRunSupport",
        "§19 support read: plan, steps, attempts, dependencies, effects",
        {"org_id": "{org}", "flow_run_id": "{run}"},
        "runtime",
    ),
    Call(
        RUNS,
        "ListRuns",
        "runs of the org, oldest first",
        {"org_id": "{org}", "flow_api_name": "CookbookPing", "page_size": 5},
        "runtime",
    ),
    Call(
        RUNS,
        "CancelRun",
        "cancel a run (needs role flow.runs.cancel)",
        {
            "request_id": "cb-cancel-{nonce}",
            "org_id": "{org}",
            "flow_run_id": "{run}",
            "reason_code": "operator_request",
        },
        "runtime",
        "DEMO_TOKEN",
        "FAILED_PRECONDITION",
        "the run already finished; only a non-terminal run is cancelled",
    ),
    Call(
        RUNS,
        "PauseRun",
        "operator pause: no step is claimed until resumed (needs role flow.runs.operate)",
        {
            "request_id": "cb-pause-{nonce}",
            "org_id": "{org}",
            "flow_run_id": "{run}",
            "reason": "INC-1 maintenance window",
        },
        "runtime",
        "DEMO_TOKEN",
        "FAILED_PRECONDITION",
        "the run already finished (run_terminal); only an active run is paused",
    ),
    Call(
        RUNS,
        "ResumeRun",
        "clear an operator pause (needs role flow.runs.operate; a run not paused answers as is)",
        {"request_id": "cb-resume-{nonce}", "org_id": "{org}", "flow_run_id": "{run}"},
        "runtime",
    ),
    Call(
        RUNS,
        "RetryQuarantinedRun",
        "retry a reconciled commit-unknown quarantine (needs role flow.runs.operate; audited)",
        {
            "request_id": "cb-retry-{nonce}",
            "org_id": "{org}",
            "flow_run_id": "{run}",
            "reason": "INC-2 marker checked: no commit",
        },
        "runtime",
        "DEMO_TOKEN",
        "FAILED_PRECONDITION",
        "the run is not quarantined (not_quarantined): nothing to retry",
    ),
    Call(
        RUNS,
        "RestartFromCheckpoint",
        "run a failed run again from one of its checkpoints (needs role flow.runs.operate)",
        {
            "request_id": "cb-restart-{nonce}",
            "org_id": "{org}",
            "flow_run_id": "{run}",
            "checkpoint_id": "{checkpoint}",
            "reason": "INC-3 downstream fixed",
        },
        "runtime",
        "DEMO_TOKEN",
        "FAILED_PRECONDITION",
        "the run succeeded (run_not_failed); only a failed run is restarted",
    ),
    Call(
        RUNS,
        "DeleteRun",
        "public delete: soft-delete (needs role flow.runs.delete)",
        {"request_id": "cb-delete-run-{nonce}", "org_id": "{org}", "flow_run_id": "{run}"},
        "runtime",
    ),
    Call(
        DEFS,
        "DeactivateFlowVersion",
        "deactivate the Flow again (in-flight runs keep their plan)",
        {
            "request_id": "cb-deactivate-{nonce}",
            "org_id": "{org}",
            "flow_version_id": "{flow_version}",
        },
        "runtime",
    ),
    # --- runtime: records ------------------------------------------------------------------
    Call(
        RECORDS,
        "CreateRecord",
        "create a Contact: the before-save Flow trims the names, the "
        "after-save WelcomeContact run starts",
        {
            "request_id": "cb-create-{nonce}",
            "scope": DEMO_SCOPE,
            "object_api_name": "Contact",
            "record_id": "{record}",
            "fields": {"FirstName": "  Grace ", "LastName": "Hopper", "Email": "grace@example.com"},
        },
        "runtime",
    ),
    Call(
        RECORDS,
        "GetRecord",
        "read it",
        {"org_id": "{org}", "object_api_name": "Contact", "record_id": "{record}"},
        "runtime",
    ),
    Call(
        RECORDS,
        "UpdateRecord",
        "update at the expected version (compare-and-swap)",
        {
            "request_id": "cb-update-{nonce}",
            "scope": DEMO_SCOPE,
            "object_api_name": "Contact",
            "record_id": "{record}",
            "expected_version": 1,
            "fields": {"LastName": "Hopper-Murray"},
        },
        "runtime",
    ),
    Call(
        RECORDS,
        "DeleteRecord",
        "soft-delete at the expected version",
        {
            "request_id": "cb-delrec-{nonce}",
            "scope": DEMO_SCOPE,
            "object_api_name": "Contact",
            "record_id": "{record}",
            "expected_version": 2,
        },
        "runtime",
    ),
    # --- runtime: wake signals ---------------------------------------------------------------
    Call(
        WAKE,
        "SubmitWakeSignal",
        "approve: wakes the AwaitApproval run `{approval_run}` the set-up started for "
        "request `cookbook-{nonce}` (a configured external kind, `external.signal`, with safe "
        "evidence and its `wake-evidence/v1` digest; needs role flow.signals.submit). "
        "Re-sending the same token answers the same signal (`duplicate`)",
        {
            "request_id": "cb-wake-{nonce}",
            "scope": DEMO_SCOPE,
            "producer_kind": APPROVAL_KIND,
            "producer_key": "approval:cookbook-{nonce}",
            "wake_token": "approve-cookbook-{nonce}",
            "evidence_json": APPROVAL_EVIDENCE,
            "evidence_digest": APPROVAL_EVIDENCE_DIGEST,
        },
        "runtime",
    ),
    Call(
        WAKE,
        "GetWakeSignal",
        "read that signal by its natural key (consumed by the run's dependency)",
        {
            "scope": DEMO_SCOPE,
            "key": {
                "producer_kind": APPROVAL_KIND,
                "producer_key": "approval:cookbook-{nonce}",
                "wake_token": "approve-cookbook-{nonce}",
            },
        },
        "runtime",
    ),
    # --- effect owner --------------------------------------------------------------------------
    Call(
        EFFECT,
        "AcceptHandoff",
        "the runtime's outbox dispatcher hands an effect over (an e-mail to the dev mail "
        "sink), signed with the runtime's own service key (`RUNTIME_TOKEN`, role "
        "effects.handoff.submit; operators never call this). The set-up handed this "
        "envelope over already, so the call answers the same command with "
        "`duplicate: true`",
        {"request_id": "cb-accept-{nonce}", "scope": DEMO_SCOPE, "envelope": "{handoff_json}"},
        "effect",
        "RUNTIME_TOKEN",
    ),
    Call(
        EFFECT,
        "GetCommand",
        "one external command, by the handoff key it was accepted for",
        {"scope": DEMO_SCOPE, "effect_handoff_key": "{handoff_key}"},
        "effect",
    ),
    Call(
        EFFECT,
        "ListCommands",
        "external commands of the work scope",
        {"scope": DEMO_SCOPE, "page_size": 5},
        "effect",
    ),
    Call(
        EFFECT,
        "GetReceipt",
        "the completion receipt of that command (the owner sent the e-mail; the "
        "receipt also went to the runtime as an `effect.completion` wake signal)",
        {"scope": DEMO_SCOPE, "command_id": "{command}"},
        "effect",
    ),
    Call(
        EFFECT,
        "RejectIfUnaccepted",
        "the runtime fences a handoff it never delivered (a second invocation's key): "
        "the owner durably records it REJECTED, so a late delivery can no longer be "
        "accepted; an accepted key would answer its ACCEPTED receipt instead "
        "(`RUNTIME_TOKEN`)",
        {
            "request_id": "cb-reject-{nonce}",
            "scope": DEMO_SCOPE,
            "effect_handoff_key": "{unsent_key}",
            "payload_digest": "{unsent_payload_digest}",
            "runtime_outbox_message_id": "{unsent_message_id}",
        },
        "effect",
        "RUNTIME_TOKEN",
    ),
)
