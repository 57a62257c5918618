"""The immutable execution plan (§7.3, §7.4) and its canonical dictionary form.

``ExecutionPlan.to_dict()`` is the storage and golden-file form: canonical,
sorted, free of timestamps and process state. ``from_dict`` inverts it
exactly. Two digests are derived:

* ``payload_digest`` — the executable graph and contracts (steps, nodes,
  edges, loop proofs, bounds, profile);
* ``plan_digest`` — the identity of §7.3: Flow identity and metadata digest,
  compiler version, catalog generation and digest, every pinned action entry
  digest / binding fingerprint / capability digest, the complete
  RuntimeWorkBinding (which names the metadata view), ``TriggerBindingDigest``,
  runtime-policy version and digest, transitive subflow plan digests, and the
  payload digest. Diagnostics are explanation, not identity, and are excluded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.digest import versioned_digest

from .diagnostics import Diagnostic
from .identity import StepPrincipal
from .inputs import CatalogGenerationRef, RuntimeWorkBindingRef, TriggerSubscription
from .kinds import EdgeKind, ExecutionProfile, ExpiryPolicy, QueueClass, StepKind, TerminalOutcome

__all__ = [
    "COMPILER_VERSION",
    "PLAN_FORMAT",
    "ActionPin",
    "BoundSummary",
    "CheckpointField",
    "CheckpointSchema",
    "DependencyDecl",
    "EffectDecl",
    "ExecutionPlan",
    "FlowIdentity",
    "LoopProof",
    "PlanEdge",
    "PlanNode",
    "PlanStep",
    "PlanVariable",
    "ResourceDecl",
    "SubflowPin",
    "Transition",
    "trigger_binding_digest",
]

#: Compiler behaviour generation; bump on any change to what a plan means.
COMPILER_VERSION = "nexus-flow-compiler/1"
#: Version of the ``to_dict`` layout.
PLAN_FORMAT = 1


def _opt(v: str | None, cls: Any) -> Any:
    return None if v is None else cls(v)


@dataclass(frozen=True, order=True)
class ResourceDecl:
    """A declared lock-plan resource (§13.2): class, object, parent, key source, bound."""

    resource_class: str
    object: str
    parent_relationship: str | None
    key_source: str
    bound: int | None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "resource_class": self.resource_class,
            "object": self.object,
            "parent_relationship": self.parent_relationship,
            "key_source": self.key_source,
            "bound": self.bound,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResourceDecl:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["resource_class"], d["object"], d["parent_relationship"], d["key_source"], d["bound"]
        )


@dataclass(frozen=True)
class BoundSummary:
    """Maximum element executions, reads, writes, fan-out and lock classes; ``None`` = unknown."""

    max_steps: int | None
    max_reads: int | None
    max_writes: int | None
    max_fanout: int | None
    lock_classes: tuple[str, ...]
    unknown: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "max_steps": self.max_steps,
            "max_reads": self.max_reads,
            "max_writes": self.max_writes,
            "max_fanout": self.max_fanout,
            "lock_classes": list(self.lock_classes),
            "unknown": list(self.unknown),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BoundSummary:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["max_steps"],
            d["max_reads"],
            d["max_writes"],
            d["max_fanout"],
            tuple(d["lock_classes"]),
            tuple(d["unknown"]),
        )


@dataclass(frozen=True, order=True)
class Transition:
    """A step-level edge: taken from node ``source`` to step ``target``."""

    kind: EdgeKind
    label: str
    source: str
    target: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "kind": self.kind.value,
            "label": self.label,
            "source": self.source,
            "target": self.target,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Transition:
        """Inverse of :meth:`to_dict`."""
        return cls(EdgeKind(d["kind"]), d["label"], d["source"], d["target"])


@dataclass(frozen=True, order=True)
class CheckpointField:
    """One named, typed value in a checkpoint."""

    name: str
    type: str


@dataclass(frozen=True)
class CheckpointSchema:
    """What a step's input checkpoint must hold and what its output adds (§10.4)."""

    inputs: tuple[CheckpointField, ...]
    outputs: tuple[CheckpointField, ...]
    cursor: tuple[str, ...] = ()
    schema_version: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "schema_version": self.schema_version,
            "inputs": [{"name": f.name, "type": f.type} for f in self.inputs],
            "outputs": [{"name": f.name, "type": f.type} for f in self.outputs],
            "cursor": list(self.cursor),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointSchema:
        """Inverse of :meth:`to_dict`."""
        return cls(
            tuple(CheckpointField(f["name"], f["type"]) for f in d["inputs"]),
            tuple(CheckpointField(f["name"], f["type"]) for f in d["outputs"]),
            tuple(d["cursor"]),
            d["schema_version"],
        )


@dataclass(frozen=True)
class DependencyDecl:
    """A durable dependency a waiting step declares (§10.5)."""

    producer_kind: str
    key: str
    condition: str | None
    condition_digest: str
    deadline: str | None
    deadline_seconds: int | None
    expiry_policy: ExpiryPolicy
    fault_successor: str | None
    #: The watched object of a record-condition wait (``None`` for every other
    #: producer; left out of the canonical form then, so older plans keep their digest).
    object: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        out: dict[str, Any] = {
            "producer_kind": self.producer_kind,
            "key": self.key,
            "condition": self.condition,
            "condition_digest": self.condition_digest,
            "deadline": self.deadline,
            "deadline_seconds": self.deadline_seconds,
            "expiry_policy": self.expiry_policy.value,
            "fault_successor": self.fault_successor,
        }
        if self.object is not None:
            out["object"] = self.object
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DependencyDecl:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["producer_kind"],
            d["key"],
            d["condition"],
            d["condition_digest"],
            d["deadline"],
            d["deadline_seconds"],
            ExpiryPolicy(d["expiry_policy"]),
            d["fault_successor"],
            d.get("object"),
        )


@dataclass(frozen=True)
class EffectDecl:
    """The immutable EffectSubmit → EffectCompletion pairing of one external effect (§7.5, §15)."""

    action_type: str
    owner_kind: str
    owner_id: str | None
    submit_step: str
    completion_step: str
    handoff_key: str
    idempotency_key_shape: str | None
    idempotency_scope: str | None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "action_type": self.action_type,
            "owner_kind": self.owner_kind,
            "owner_id": self.owner_id,
            "submit_step": self.submit_step,
            "completion_step": self.completion_step,
            "handoff_key": self.handoff_key,
            "idempotency_key_shape": self.idempotency_key_shape,
            "idempotency_scope": self.idempotency_scope,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EffectDecl:
        """Inverse of :meth:`to_dict`."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True, order=True)
class ActionPin:
    """A catalog entry a plan executes, pinned exactly (§7.4, §8.2)."""

    action_type: str
    entry_digest: str
    binding_fingerprint: str
    capability_digest: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "action_type": self.action_type,
            "entry_digest": self.entry_digest,
            "binding_fingerprint": self.binding_fingerprint,
            "capability_digest": self.capability_digest,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ActionPin:
        """Inverse of :meth:`to_dict`."""
        return cls(
            d["action_type"], d["entry_digest"], d["binding_fingerprint"], d["capability_digest"]
        )


@dataclass(frozen=True)
class PlanStep:
    """One compiled step (§7.5) with its resource plan, checkpoint and dependency contracts."""

    key: str
    kind: StepKind
    entry: str
    nodes: tuple[str, ...]
    transitions: tuple[Transition, ...]
    queue_class: QueueClass | None
    bounds: BoundSummary
    resources: tuple[ResourceDecl, ...] = ()
    checkpoint: CheckpointSchema | None = None
    dependency: DependencyDecl | None = None
    effect: EffectDecl | None = None
    actions: tuple[ActionPin, ...] = ()
    verifies: tuple[str, ...] = ()
    outcome: TerminalOutcome | None = None
    fault_code: str | None = None
    #: The declared execution principal (§17; durable non-terminal steps only).
    principal: StepPrincipal | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (``principal`` only when declared, so the plans of the other
        profiles keep their digests)."""
        extra = {} if self.principal is None else {"principal": self.principal.to_dict()}
        return {
            **extra,
            "key": self.key,
            "kind": self.kind.value,
            "entry": self.entry,
            "nodes": list(self.nodes),
            "transitions": [t.to_dict() for t in self.transitions],
            "queue_class": None if self.queue_class is None else self.queue_class.value,
            "bounds": self.bounds.to_dict(),
            "resources": [r.to_dict() for r in self.resources],
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_dict(),
            "dependency": None if self.dependency is None else self.dependency.to_dict(),
            "effect": None if self.effect is None else self.effect.to_dict(),
            "actions": [a.to_dict() for a in self.actions],
            "verifies": list(self.verifies),
            "outcome": None if self.outcome is None else self.outcome.value,
            "fault_code": self.fault_code,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanStep:
        """Inverse of :meth:`to_dict`."""
        return cls(
            key=d["key"],
            kind=StepKind(d["kind"]),
            entry=d["entry"],
            nodes=tuple(d["nodes"]),
            transitions=tuple(Transition.from_dict(t) for t in d["transitions"]),
            queue_class=_opt(d["queue_class"], QueueClass),
            bounds=BoundSummary.from_dict(d["bounds"]),
            resources=tuple(ResourceDecl.from_dict(r) for r in d["resources"]),
            checkpoint=None
            if d["checkpoint"] is None
            else CheckpointSchema.from_dict(d["checkpoint"]),
            dependency=None
            if d["dependency"] is None
            else DependencyDecl.from_dict(d["dependency"]),
            effect=None if d["effect"] is None else EffectDecl.from_dict(d["effect"]),
            actions=tuple(ActionPin.from_dict(a) for a in d["actions"]),
            verifies=tuple(d["verifies"]),
            outcome=_opt(d["outcome"], TerminalOutcome),
            fault_code=d["fault_code"],
            principal=(
                None if d.get("principal") is None else StepPrincipal.from_dict(d["principal"])
            ),
        )


@dataclass(frozen=True, order=True)
class PlanEdge:
    """A CFG edge between two plan nodes."""

    src: str
    dst: str
    kind: EdgeKind
    label: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {"src": self.src, "dst": self.dst, "kind": self.kind.value, "label": self.label}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanEdge:
        """Inverse of :meth:`to_dict`."""
        return cls(d["src"], d["dst"], EdgeKind(d["kind"]), d["label"])


@dataclass(frozen=True)
class PlanNode:
    """One CFG node with its normalized element, so a plan executes without its source."""

    id: str
    type: str
    scope: tuple[str, ...]
    element: Mapping[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "id": self.id,
            "type": self.type,
            "scope": list(self.scope),
            "element": self.element,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanNode:
        """Inverse of :meth:`to_dict`."""
        return cls(d["id"], d["type"], tuple(d["scope"]), d["element"])


@dataclass(frozen=True, order=True)
class PlanVariable:
    """A variable the plan's checkpoints carry; child names are subflow-qualified."""

    name: str
    type: str
    input: bool = False
    output: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {"name": self.name, "type": self.type, "input": self.input, "output": self.output}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanVariable:
        """Inverse of :meth:`to_dict`."""
        return cls(d["name"], d["type"], d["input"], d["output"])


@dataclass(frozen=True, order=True)
class LoopProof:
    """How a loop's bound was proven (``declared``/``metadata``) or that it is ``unknown``."""

    loop: str
    kind: str
    bound: int | None
    source: str
    multiplicity: int | None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "loop": self.loop,
            "kind": self.kind,
            "bound": self.bound,
            "source": self.source,
            "multiplicity": self.multiplicity,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoopProof:
        """Inverse of :meth:`to_dict`."""
        return cls(d["loop"], d["kind"], d["bound"], d["source"], d["multiplicity"])


@dataclass(frozen=True, order=True)
class SubflowPin:
    """A Flow version reached through Subflow elements, pinned by its plan digest."""

    api_name: str
    version: int
    plan_digest: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {"api_name": self.api_name, "version": self.version, "plan_digest": self.plan_digest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SubflowPin:
        """Inverse of :meth:`to_dict`."""
        return cls(d["api_name"], d["version"], d["plan_digest"])


@dataclass(frozen=True)
class FlowIdentity:
    """The source Flow version of a plan."""

    api_name: str
    version: int
    process_type: str
    metadata_digest: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "api_name": self.api_name,
            "version": self.version,
            "process_type": self.process_type,
            "metadata_digest": self.metadata_digest,
        }


def trigger_binding_digest(
    flow_api_name: str, flow_version: int, subs: tuple[TriggerSubscription, ...]
) -> str:
    """``TriggerBindingDigest``: the normalized subscriptions and dispatch selection of one Flow."""
    return versioned_digest(
        "trigger-binding",
        {
            "flow": {"api_name": flow_api_name, "version": flow_version},
            "subscriptions": sorted(
                (s.to_dict() for s in subs),
                key=lambda d: (d["object"], d["timing"], d["dispatch_order"], d["events"]),
            ),
        },
    )


def _subs_from(d: Mapping[str, Any]) -> TriggerSubscription:
    return TriggerSubscription(
        d["flow_api_name"],
        d["flow_version"],
        d["object"],
        d["timing"],
        tuple(d["events"]),
        d["dispatch_order"],
    )


@dataclass(frozen=True)
class ExecutionPlan:
    """An immutable compiled plan. Build with :func:`~.compile.compile_plan` only."""

    compiler_version: str
    flow: FlowIdentity
    binding: RuntimeWorkBindingRef
    catalog: CatalogGenerationRef
    trigger_binding_digest: str
    trigger_subscriptions: tuple[TriggerSubscription, ...]
    policy_version: int
    policy_digest: str
    profile: ExecutionProfile
    requested_profile: ExecutionProfile | None
    trigger: Mapping[str, Any] | None
    variables: tuple[PlanVariable, ...]
    start_step: str
    steps: tuple[PlanStep, ...]
    nodes: tuple[PlanNode, ...]
    edges: tuple[PlanEdge, ...]
    loops: tuple[LoopProof, ...]
    actions: tuple[ActionPin, ...]
    subflows: tuple[SubflowPin, ...]
    bounds: BoundSummary
    diagnostics: tuple[Diagnostic, ...]
    payload_digest: str = ""
    plan_digest: str = ""
    format: int = PLAN_FORMAT

    def step(self, key: str) -> PlanStep:
        """The step with ``key``.

        Raises:
            KeyError: no such step.
        """
        for s in self.steps:
            if s.key == key:
                return s
        raise KeyError(key)

    @property
    def step_keys(self) -> tuple[str, ...]:
        """Every step key, sorted."""
        return tuple(s.key for s in self.steps)

    def payload_dict(self) -> dict[str, Any]:
        """The executable payload (input of ``payload_digest``)."""
        return {
            "profile": self.profile.value,
            "trigger": self.trigger,
            "variables": [v.to_dict() for v in self.variables],
            "start_step": self.start_step,
            "steps": [s.to_dict() for s in self.steps],
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [e.to_dict() for e in self.edges],
            "loops": [lp.to_dict() for lp in self.loops],
            "bounds": self.bounds.to_dict(),
        }

    def identity_dict(self) -> dict[str, Any]:
        """Everything §7.3 puts in the plan identity (input of ``plan_digest``)."""
        return {
            "format": self.format,
            "compiler_version": self.compiler_version,
            "flow": self.flow.to_dict(),
            "binding": self.binding.to_dict(),
            "catalog": self.catalog.to_dict(),
            "actions": [a.to_dict() for a in self.actions],
            "trigger_binding_digest": self.trigger_binding_digest,
            "policy": {"version": self.policy_version, "digest": self.policy_digest},
            "subflows": [s.to_dict() for s in self.subflows],
            "requested_profile": None
            if self.requested_profile is None
            else self.requested_profile.value,
            "payload_digest": versioned_digest("plan-payload", self.payload_dict()),
        }

    def computed_digests(self) -> tuple[str, str]:
        """``(payload_digest, plan_digest)`` recomputed from content."""
        ident = self.identity_dict()
        return ident["payload_digest"], versioned_digest("plan", ident)

    def verify(self) -> bool:
        """True when the stored digests match the content (storage integrity check)."""
        return self.computed_digests() == (self.payload_digest, self.plan_digest)

    def to_dict(self) -> dict[str, Any]:
        """Canonical storage / golden-file form."""
        ident = self.identity_dict()
        return {
            **ident,
            "trigger_subscriptions": [s.to_dict() for s in self.trigger_subscriptions],
            "payload": self.payload_dict(),
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "payload_digest": self.payload_digest,
            "plan_digest": self.plan_digest,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExecutionPlan:
        """Inverse of :meth:`to_dict` (digests are carried, check them with :meth:`verify`)."""
        p = d["payload"]
        f = d["flow"]
        req = d["requested_profile"]
        return cls(
            format=d["format"],
            compiler_version=d["compiler_version"],
            flow=FlowIdentity(f["api_name"], f["version"], f["process_type"], f["metadata_digest"]),
            binding=RuntimeWorkBindingRef.from_dict(d["binding"]),
            catalog=CatalogGenerationRef.from_dict(d["catalog"]),
            trigger_binding_digest=d["trigger_binding_digest"],
            trigger_subscriptions=tuple(_subs_from(s) for s in d["trigger_subscriptions"]),
            policy_version=d["policy"]["version"],
            policy_digest=d["policy"]["digest"],
            profile=ExecutionProfile(p["profile"]),
            requested_profile=None if req is None else ExecutionProfile(req),
            trigger=p["trigger"],
            variables=tuple(PlanVariable.from_dict(v) for v in p["variables"]),
            start_step=p["start_step"],
            steps=tuple(PlanStep.from_dict(s) for s in p["steps"]),
            nodes=tuple(PlanNode.from_dict(n) for n in p["nodes"]),
            edges=tuple(PlanEdge.from_dict(e) for e in p["edges"]),
            loops=tuple(LoopProof.from_dict(lp) for lp in p["loops"]),
            actions=tuple(ActionPin.from_dict(a) for a in d["actions"]),
            subflows=tuple(SubflowPin.from_dict(s) for s in d["subflows"]),
            bounds=BoundSummary.from_dict(p["bounds"]),
            diagnostics=tuple(Diagnostic.from_dict(x) for x in d["diagnostics"]),
            payload_digest=d["payload_digest"],
            plan_digest=d["plan_digest"],
        )
