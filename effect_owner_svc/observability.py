"""The effect owner's telemetry: spans and metric hooks of acceptance, dispatch and
provider calls, and its authoritative-state gauges (spec §19; ``docs/operations.md``).

The owner continues the Flow run's trace: ``AcceptHandoff``'s server span continues the
runtime dispatcher's call, :func:`accept_span` is current while the command row is
written (its ``trace_context`` is that span's), :func:`command_span` continues it when
a dispatcher picks the command up, and :func:`provider_call` wraps each provider call
(the completion receipt enqueued afterwards inside the command span carries it on to the
runtime's ``SubmitWakeSignal``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from effect_owner_svc.commands.model import CommandState
from effect_owner_svc.commands.records import CommandRecord
from effect_owner_svc.inbox.store import Accepted, Refusal
from effect_owner_svc.providers.base import ProviderOutcome, ProviderOutcomeKind
from effect_owner_svc.schema import external_commands
from services.metrics import StateFamily, metrics
from services.metrics_state import Sample, capped_count, distinct_orgs, due_age, oldest
from services.telemetry import parent_of, span

__all__ = [
    "ACCEPT_SPAN",
    "COMMAND_SPAN",
    "PROVIDER_SPAN",
    "CommandStateSource",
    "ProviderCall",
    "accept_span",
    "command_span",
    "handoff_decided",
    "provider_call",
]

ACCEPT_SPAN = "effect.handoff.accept"
COMMAND_SPAN = "effect.command.dispatch"
PROVIDER_SPAN = "effect.provider.call"
_DUE = (CommandState.ACCEPTED.value, CommandState.OUTCOME_UNKNOWN.value)


@contextmanager
def accept_span(envelope_context: Any, message_id: str) -> Iterator[Span]:
    """The acceptance span: a child of the ``AcceptHandoff`` server span, or of the
    envelope's trace context when the call carried none."""
    with span(
        ACCEPT_SPAN,
        parent=parent_of(None, dict(envelope_context)),
        attributes={"nexus.flow.runtime_outbox_message_id": message_id},
    ) as current:
        yield current


def handoff_decided(value: Accepted | Refusal | None) -> None:
    """Count one acceptance decision (None: a replayed request)."""
    if value is None:
        decision = "replayed"
    elif isinstance(value, Refusal):
        decision = "rejected" if value.reason is None else "mismatch"
    else:
        decision = "duplicate" if value.duplicate else "accepted"
    metrics().handoff_decided(decision)


@contextmanager
def command_span(command: CommandRecord) -> Iterator[Span]:
    """One dispatch of ``command``, continuing the trace its acceptance stored."""
    with span(
        COMMAND_SPAN,
        parent=command.trace_context,
        kind=SpanKind.CONSUMER,
        attributes={
            "nexus.flow.command_id": command.command_id,
            "nexus.flow.owner_kind": command.effect_owner_kind,
            "nexus.flow.attempt_count": command.attempt_count,
        },
    ) as current:
        yield current


class ProviderCall:
    """Records the outcome of one provider call (see :func:`provider_call`)."""

    def __init__(self, current: Span) -> None:
        self._span = current
        self.outcome = "error"

    def done(self, outcome: ProviderOutcome) -> ProviderOutcome:
        """Note ``outcome`` (returned unchanged); a call left without one (a provider
        with no lookup) counts as ``none``."""
        self.outcome = outcome.kind.value.lower()
        self._span.set_attribute("nexus.flow.provider_outcome", self.outcome)
        if outcome.safe_error_code:
            self._span.set_attribute("nexus.flow.safe_error_code", outcome.safe_error_code)
        if outcome.kind is not ProviderOutcomeKind.SUCCEEDED:
            self._span.set_status(Status(StatusCode.ERROR, self.outcome))
        return outcome


@contextmanager
def provider_call(owner_kind: str, call: str) -> Iterator[ProviderCall]:
    """A CLIENT span and the metrics of one provider ``call`` (``submit``/``lookup``)."""
    started = time.perf_counter()
    with span(
        PROVIDER_SPAN,
        kind=SpanKind.CLIENT,
        attributes={"nexus.flow.owner_kind": owner_kind, "nexus.flow.provider_call": call},
    ) as current:
        recorder = ProviderCall(current)
        try:
            yield recorder
        finally:
            metrics().provider_called(
                owner_kind, call, recorder.outcome, time.perf_counter() - started
            )


class CommandStateSource:
    """The owner's :class:`~services.metrics_state.StateSource`: commands by state and
    the oldest due command's age (``ix_external_commands_due``).

    Args:
        count_cap: cap of each count.
    """

    def __init__(self, *, count_cap: int = 10000) -> None:
        self._cap = count_cap
        self._states = [s.value for s in CommandState]
        # One org's probe, built once (the org is bound per probe).
        c = external_commands.c
        org = c.org_id == bindparam("org_id", type_=c.org_id.type)
        columns = [
            capped_count(external_commands, org, c.state == s, cap=self._cap) for s in self._states
        ]
        columns += [oldest(c.next_attempt_at, org, c.state == s) for s in _DUE]
        self._probe = select(*columns)

    @property
    def families(self) -> Sequence[StateFamily]:
        return (
            StateFamily(
                "nexus_flow_effect_commands",
                "External commands by state (capped per org and state).",
                ("state",),
            ),
            StateFamily(
                "nexus_flow_effect_command_oldest_due_age_seconds",
                "Age of the oldest command due for a provider call (0: none due).",
            ),
        )

    def baseline(self) -> Sequence[Sample]:
        return [
            *(Sample("nexus_flow_effect_commands", (s,), 0) for s in self._states),
            Sample("nexus_flow_effect_command_oldest_due_age_seconds", (), 0, "max"),
        ]

    async def orgs(self, conn: AsyncConnection, after: str, limit: int) -> list[str]:
        return await distinct_orgs(conn, external_commands, after, limit)

    async def probe(self, conn: AsyncConnection, org_id: str, now: datetime) -> list[Sample]:
        row = list((await conn.execute(self._probe, {"org_id": org_id})).one())
        samples = [
            Sample("nexus_flow_effect_commands", (s,), float(row.pop(0) or 0)) for s in self._states
        ]
        age = max(due_age(row.pop(0), now) for _ in _DUE)
        samples.append(Sample("nexus_flow_effect_command_oldest_due_age_seconds", (), age, "max"))
        return samples
