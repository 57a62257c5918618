"""Closed vocabularies shared by the compiler, its plans and their readers.

Values are lower-case strings so that golden plans and digests read naturally;
the API layer mirrors them as proto enums (``<ENUM>_UNSPECIFIED = 0``).
"""

from __future__ import annotations

from enum import StrEnum

#: Producer kind of a time wait (``Deadline``/``RunAfter`` of the dependency; §14.4).
TIMER_PRODUCER = "runtime.timer"
#: Producer kind of a record-condition wait: the record engine signals record changes.
RECORD_CHANGE_PRODUCER = "record.change"
#: Producer-kind family of an effect completion (the owner's completion receipts).
EFFECT_COMPLETION_PRODUCER = "effect.completion"

__all__ = [
    "EFFECT_COMPLETION_PRODUCER",
    "RECORD_CHANGE_PRODUCER",
    "TIMER_PRODUCER",
    "EdgeKind",
    "ExecutionProfile",
    "ExpiryPolicy",
    "QueueClass",
    "StepKind",
    "TerminalOutcome",
]


class ExecutionProfile(StrEnum):
    """The three execution profiles of §9."""

    EMBEDDED_BEFORE_SAVE = "embedded_before_save"
    BOUNDED_ATOMIC = "bounded_atomic"
    DURABLE_ORCHESTRATION = "durable_orchestration"


class StepKind(StrEnum):
    """The step kinds of §7.5."""

    EMBEDDED_TRANSFORM = "EmbeddedTransform"
    PURE_COMPUTE = "PureCompute"
    CURRENT_READ = "CurrentRead"
    VERIFIED_SNAPSHOT_READ = "VerifiedSnapshotRead"
    BOUNDED_MUTATION = "BoundedMutation"
    DEPENDENCY_WAIT = "DependencyWait"
    EFFECT_SUBMIT = "EffectSubmit"
    EFFECT_COMPLETION = "EffectCompletion"
    EXPLICIT_FAULT = "ExplicitFault"
    TERMINAL = "Terminal"


class EdgeKind(StrEnum):
    """Control-flow edge classes (§7.2 step 3)."""

    SUCCESS = "success"
    FAULT = "fault"
    WAIT = "wait"
    TERMINAL = "terminal"


class ExpiryPolicy(StrEnum):
    """What a dependency's deadline does (§10.5, §14.3)."""

    FAULT_PATH = "fault_path"
    TERMINAL_FAILURE = "terminal_failure"
    QUARANTINE = "quarantine"


class QueueClass(StrEnum):
    """The six admission lanes of §16.1 (``queue_class`` on runs and step executions).

    Scheduling classes, not fact authorities: the compiler assigns the first four to
    plan steps; ``MAINTENANCE`` is the recovery/reconciliation work of the sweeps, which
    admission (``runtime_svc.admission``) keeps moving under pressure. Member names match
    the proto's ``QUEUE_CLASS_*`` values.
    """

    EMBEDDED_FOREGROUND = "embedded_foreground"
    BOUNDED_ATOMIC_FOREGROUND = "bounded_atomic_foreground"
    DURABLE_MUTATION = "durable_mutation"
    DEPENDENCY_WAKEUP = "dependency_wakeup"
    EFFECT_COMPLETION = "effect_completion"
    MAINTENANCE = "maintenance_reconciliation"


class TerminalOutcome(StrEnum):
    """How a ``Terminal`` step ends the run."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
