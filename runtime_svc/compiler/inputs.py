"""The compiler's own input types (§7.1, §8.4, §16.3).

These are plain frozen values. The runtime service's API layer builds them from
the catalog service's protos (the compiler never imports ``catalog_svc`` nor
generated code); tests and the CLI build them from JSON with ``from_dict``.

A capability value that the catalog did not declare is represented as
``UNKNOWN`` (or ``None`` for free-form fields): §8.4 makes an unknown
capability fail closed for Bounded Atomic, so "missing" must stay visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from runtime_svc.admission.budgets import AdmissionPolicy
from services.digest import versioned_digest

from ._fields import (
    FieldError,
    opt_int,
    opt_str,
    req_bool,
    req_int,
    req_map,
    req_seq,
    req_str,
    str_tuple,
)
from .catalog_inputs import (
    CapabilityDescriptor,
    CapabilityEntryView,
    CatalogGenerationRef,
    EffectOwner,
    EffectOwnerKind,
    ExecutionClass,
    FanoutBound,
    FanoutKind,
    IdempotencyPolicy,
    LockPlan,
    LockPlanKind,
    OutputDurability,
    ReadContract,
    ReplayPolicy,
    SecurityPolicy,
    TransactionPolicy,
)
from .kinds import ExecutionProfile

__all__ = [
    "DEFAULT_WAIT_POLICY",
    "ActionMetadata",
    "ActionParam",
    "CapabilityDescriptor",
    "CapabilityEntryView",
    "CatalogGenerationRef",
    "CompilerInputs",
    "EffectOwner",
    "EffectOwnerKind",
    "ExecutionClass",
    "FanoutBound",
    "FanoutKind",
    "FieldError",
    "FieldView",
    "IdempotencyPolicy",
    "LegacyAtomicMapping",
    "LockPlan",
    "LockPlanKind",
    "MetadataViewInput",
    "ObjectView",
    "OutputDurability",
    "ProfileBounds",
    "ReadContract",
    "RelationshipView",
    "ReplayPolicy",
    "RuntimePolicy",
    "RuntimeWorkBindingRef",
    "SecurityPolicy",
    "SubflowSource",
    "TransactionPolicy",
    "TriggerSubscription",
    "WaitPolicy",
    "WaitProducer",
]


class LegacyAtomicMapping(StrEnum):
    """What a ``run_atomically`` request that fails its proof does (§9.2).

    ``REJECT`` fails activation. ``DURABLE_ORCHESTRATION`` is the explicit,
    versioned migration mapping §9.2 allows: the plan is Durable and carries a
    warning naming every blocker, so the mapping is visible.
    """

    REJECT = "reject"
    DURABLE_ORCHESTRATION = "durable_orchestration"


# ------------------------------------------------------------ binding/view


@dataclass(frozen=True)
class RuntimeWorkBindingRef:
    """The complete RuntimeWorkBinding tuple a plan is bound to (§7.1, §7.4)."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    catalog_revision: int
    schema_generation: int
    engine_generation: int
    catalog_snapshot_digest: str
    metadata_view_digest: str
    binding_digest: str

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "org_id": self.org_id,
            "app_installation_id": self.app_installation_id,
            "runtime_capability_id": self.runtime_capability_id,
            "catalog_revision": self.catalog_revision,
            "schema_generation": self.schema_generation,
            "engine_generation": self.engine_generation,
            "catalog_snapshot_digest": self.catalog_snapshot_digest,
            "metadata_view_digest": self.metadata_view_digest,
            "binding_digest": self.binding_digest,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "binding") -> RuntimeWorkBindingRef:
        """Decode from JSON."""
        return cls(
            org_id=req_str(d, "org_id", where),
            app_installation_id=req_str(d, "app_installation_id", where),
            runtime_capability_id=req_str(d, "runtime_capability_id", where),
            catalog_revision=req_int(d, "catalog_revision", where),
            schema_generation=req_int(d, "schema_generation", where),
            engine_generation=req_int(d, "engine_generation", where),
            catalog_snapshot_digest=req_str(d, "catalog_snapshot_digest", where),
            metadata_view_digest=req_str(d, "metadata_view_digest", where),
            binding_digest=req_str(d, "binding_digest", where),
        )


@dataclass(frozen=True)
class FieldView:
    """One field of an object in the metadata view."""

    name: str
    type: str
    reference_to: str | None = None


@dataclass(frozen=True)
class ObjectView:
    """One object schema; ``history_tracked`` writes reserve a history sequence."""

    api_name: str
    fields: tuple[FieldView, ...]
    history_tracked: bool = False

    def field(self, name: str) -> FieldView | None:
        """The named field, or ``None``."""
        return next((f for f in self.fields if f.name == name), None)


@dataclass(frozen=True)
class RelationshipView:
    """A parent/child relationship; ``field`` is the lookup field on the child.

    ``max_children`` is the metadata-declared fan-out bound (``None`` = unbounded);
    ``lock_parent`` says a child write must lock the parent (master-detail).
    """

    name: str
    parent_object: str
    child_object: str
    field: str
    max_children: int | None = None
    lock_parent: bool = False


@dataclass(frozen=True)
class TriggerSubscription:
    """One normalized trigger subscription published in the metadata view."""

    flow_api_name: str
    flow_version: int
    object: str
    timing: str
    events: tuple[str, ...]
    dispatch_order: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (events sorted)."""
        return {
            "flow_api_name": self.flow_api_name,
            "flow_version": self.flow_version,
            "object": self.object,
            "timing": self.timing,
            "events": sorted(self.events),
            "dispatch_order": self.dispatch_order,
        }


@dataclass(frozen=True)
class ActionParam:
    """One declared input or output parameter of an action."""

    name: str
    type: str
    required: bool = False
    sensitive: bool = False


@dataclass(frozen=True)
class ActionMetadata:
    """Parameters of one action type as published in the metadata view."""

    action_type: str
    inputs: tuple[ActionParam, ...] = ()
    outputs: tuple[ActionParam, ...] = ()


@dataclass(frozen=True)
class WaitProducer:
    """A registered wait producer kind (§14.1) and its reconciliation strategy."""

    kind: str
    reconciliation: str = "event"


def _params(d: Mapping[str, Any], key: str, where: str) -> tuple[ActionParam, ...]:
    out = []
    for i, p in enumerate(req_seq(d, key, where, default_empty=True)):
        w = f"{where}.{key}[{i}]"
        out.append(
            ActionParam(
                name=req_str(p, "name", w),
                type=req_str(p, "type", w),
                required=req_bool(p, "required", w, default=False),
                sensitive=req_bool(p, "sensitive", w, default=False),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class MetadataViewInput:
    """One immutable RuntimeMetadataView: schema, relationships, triggers, actions."""

    digest: str
    objects: tuple[ObjectView, ...] = ()
    relationships: tuple[RelationshipView, ...] = ()
    trigger_subscriptions: tuple[TriggerSubscription, ...] = ()
    actions: tuple[ActionMetadata, ...] = ()
    wait_producers: tuple[WaitProducer, ...] = ()

    def object(self, name: str) -> ObjectView | None:
        """The named object, or ``None``."""
        return next((o for o in self.objects if o.api_name == name), None)

    def relationship(self, name: str) -> RelationshipView | None:
        """The named relationship, or ``None``."""
        return next((r for r in self.relationships if r.name == name), None)

    def relationship_for(self, child_object: str, child_field: str) -> RelationshipView | None:
        """The relationship whose lookup is ``child_object.child_field``."""
        return next(
            (
                r
                for r in self.relationships
                if r.child_object == child_object and r.field == child_field
            ),
            None,
        )

    def action(self, action_type: str) -> ActionMetadata | None:
        """Published parameters of an action type, or ``None``."""
        return next((a for a in self.actions if a.action_type == action_type), None)

    def producer(self, kind: str) -> WaitProducer | None:
        """A registered wait producer, or ``None``."""
        return next((p for p in self.wait_producers if p.kind == kind), None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "metadata_view") -> MetadataViewInput:
        """Decode from JSON."""
        objects = []
        for i, o in enumerate(req_seq(d, "objects", where, default_empty=True)):
            w = f"{where}.objects[{i}]"
            fields = tuple(
                FieldView(
                    name=req_str(f, "name", w),
                    type=req_str(f, "type", w),
                    reference_to=opt_str(f, "reference_to", w),
                )
                for f in req_seq(o, "fields", w, default_empty=True)
            )
            objects.append(
                ObjectView(
                    api_name=req_str(o, "api_name", w),
                    fields=fields,
                    history_tracked=req_bool(o, "history_tracked", w, default=False),
                )
            )
        rels = []
        for i, r in enumerate(req_seq(d, "relationships", where, default_empty=True)):
            w = f"{where}.relationships[{i}]"
            rels.append(
                RelationshipView(
                    name=req_str(r, "name", w),
                    parent_object=req_str(r, "parent_object", w),
                    child_object=req_str(r, "child_object", w),
                    field=req_str(r, "field", w),
                    max_children=opt_int(r, "max_children", w),
                    lock_parent=req_bool(r, "lock_parent", w, default=False),
                )
            )
        subs = []
        for i, s in enumerate(req_seq(d, "trigger_subscriptions", where, default_empty=True)):
            w = f"{where}.trigger_subscriptions[{i}]"
            subs.append(
                TriggerSubscription(
                    flow_api_name=req_str(s, "flow_api_name", w),
                    flow_version=req_int(s, "flow_version", w),
                    object=req_str(s, "object", w),
                    timing=req_str(s, "timing", w),
                    events=str_tuple(s, "events", w),
                    dispatch_order=opt_int(s, "dispatch_order", w) or 0,
                )
            )
        actions = []
        for i, a in enumerate(req_seq(d, "actions", where, default_empty=True)):
            w = f"{where}.actions[{i}]"
            actions.append(
                ActionMetadata(
                    action_type=req_str(a, "action_type", w),
                    inputs=_params(a, "inputs", w),
                    outputs=_params(a, "outputs", w),
                )
            )
        producers = tuple(
            WaitProducer(
                kind=req_str(p, "kind", f"{where}.wait_producers[{i}]"),
                reconciliation=opt_str(p, "reconciliation", f"{where}.wait_producers[{i}]")
                or "event",
            )
            for i, p in enumerate(req_seq(d, "wait_producers", where, default_empty=True))
        )
        return cls(
            digest=req_str(d, "digest", where),
            objects=tuple(objects),
            relationships=tuple(rels),
            trigger_subscriptions=tuple(subs),
            actions=tuple(actions),
            wait_producers=producers,
        )


# ------------------------------------------------------------------ policy


@dataclass(frozen=True)
class ProfileBounds:
    """Per-transaction bounds one profile admits (§16.3).

    Bounds are per step: for Embedded Before-Save and Bounded Atomic the whole
    Flow is one step, for Durable Orchestration each mutation/read step is
    checked on its own. ``max_steps`` bounds element executions inside one step.
    """

    max_steps: int
    max_reads: int
    max_writes: int
    max_fanout: int
    lock_classes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "max_steps": self.max_steps,
            "max_reads": self.max_reads,
            "max_writes": self.max_writes,
            "max_fanout": self.max_fanout,
            "lock_classes": sorted(self.lock_classes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> ProfileBounds:
        """Decode from JSON."""
        return cls(
            max_steps=req_int(d, "max_steps", where),
            max_reads=req_int(d, "max_reads", where),
            max_writes=req_int(d, "max_writes", where),
            max_fanout=req_int(d, "max_fanout", where),
            lock_classes=str_tuple(d, "lock_classes", where),
        )


@dataclass(frozen=True)
class WaitPolicy:
    """Reconciliation bounds of durable waits (§14.4): how often and how many times the
    periodic reconciler probes a pending dependency, and how long an unmatched signal
    stays queryable beyond the maximum wait (the repair window, §10.6).

    Probe ``n`` (1-based) is due ``min(probe_max_seconds, probe_initial_seconds *
    2 ** (n - 1))`` seconds after the previous one, jittered; after
    ``max_reconciliation_attempts`` probes a dependency is only woken by notifications
    or its deadline — a missing producer never causes infinite polling.
    """

    max_reconciliation_attempts: int = 12
    probe_initial_seconds: int = 5
    probe_max_seconds: int = 600
    signal_retention_seconds: int = 86_400

    def __post_init__(self) -> None:
        if self.max_reconciliation_attempts < 0:
            raise FieldError("waits.max_reconciliation_attempts must be >= 0")
        if not 0 < self.probe_initial_seconds <= self.probe_max_seconds:
            raise FieldError("waits: need 0 < probe_initial_seconds <= probe_max_seconds")
        if self.signal_retention_seconds < 0:
            raise FieldError("waits.signal_retention_seconds must be >= 0")

    def probe_delay_seconds(self, attempt: int) -> int:
        """Seconds before probe ``attempt`` (1-based), before jitter."""
        exponent = min(max(attempt - 1, 0), 30)
        return min(self.probe_max_seconds, self.probe_initial_seconds * (1 << exponent))

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "max_reconciliation_attempts": self.max_reconciliation_attempts,
            "probe_initial_seconds": self.probe_initial_seconds,
            "probe_max_seconds": self.probe_max_seconds,
            "signal_retention_seconds": self.signal_retention_seconds,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> WaitPolicy:
        """Decode from JSON (absent keys take the defaults)."""
        default = cls()
        unknown = sorted(set(d) - set(default.to_dict()))
        if unknown:
            raise FieldError(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = {k: opt_int(d, k, where) for k in default.to_dict()}
        return cls(**{k: v for k, v in values.items() if v is not None})


#: The wait bounds of a policy document without a ``waits`` section.
DEFAULT_WAIT_POLICY = WaitPolicy()


@dataclass(frozen=True)
class RuntimePolicy:
    """A versioned runtime-policy generation: the bounds the compiler checks.

    ``max_wait_seconds`` is the maximum wait age; ``waits`` the reconciliation bounds
    (``None``: :data:`DEFAULT_WAIT_POLICY`, and the section is left out of the canonical
    form, so documents written before it existed keep their digest); ``admission`` the
    §16.2 budgets (:mod:`runtime_svc.admission.budgets`; ``None``: unbounded, left out of
    the canonical form the same way).
    """

    version: int
    embedded_before_save: ProfileBounds
    bounded_atomic: ProfileBounds
    durable_orchestration: ProfileBounds
    max_wait_seconds: int
    legacy_atomic_mapping: LegacyAtomicMapping = LegacyAtomicMapping.REJECT
    waits: WaitPolicy | None = None
    admission: AdmissionPolicy | None = None

    @property
    def admission_policy(self) -> AdmissionPolicy:
        """The effective admission budgets."""
        return self.admission or AdmissionPolicy()

    @property
    def wait_policy(self) -> WaitPolicy:
        """The effective wait bounds."""
        return self.waits or DEFAULT_WAIT_POLICY

    def bounds_for(self, profile: ExecutionProfile) -> ProfileBounds:
        """The bounds of ``profile``."""
        return {
            ExecutionProfile.EMBEDDED_BEFORE_SAVE: self.embedded_before_save,
            ExecutionProfile.BOUNDED_ATOMIC: self.bounded_atomic,
            ExecutionProfile.DURABLE_ORCHESTRATION: self.durable_orchestration,
        }[profile]

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "version": self.version,
            "embedded_before_save": self.embedded_before_save.to_dict(),
            "bounded_atomic": self.bounded_atomic.to_dict(),
            "durable_orchestration": self.durable_orchestration.to_dict(),
            "max_wait_seconds": self.max_wait_seconds,
            "legacy_atomic_mapping": self.legacy_atomic_mapping.value,
            **({} if self.waits is None else {"waits": self.waits.to_dict()}),
            **({} if self.admission is None else {"admission": self.admission.to_dict()}),
        }

    def policy_digest(self) -> str:
        """Digest of this policy generation (enters every plan digest)."""
        return versioned_digest("runtime-policy", self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "policy") -> RuntimePolicy:
        """Decode from JSON."""
        mapping = d.get("legacy_atomic_mapping", LegacyAtomicMapping.REJECT.value)
        try:
            legacy = LegacyAtomicMapping(mapping)
        except ValueError as exc:
            raise FieldError(f"{where}.legacy_atomic_mapping: unknown value {mapping!r}") from exc
        return cls(
            version=req_int(d, "version", where),
            embedded_before_save=ProfileBounds.from_dict(
                req_map(d, "embedded_before_save", where), f"{where}.embedded_before_save"
            ),
            bounded_atomic=ProfileBounds.from_dict(
                req_map(d, "bounded_atomic", where), f"{where}.bounded_atomic"
            ),
            durable_orchestration=ProfileBounds.from_dict(
                req_map(d, "durable_orchestration", where), f"{where}.durable_orchestration"
            ),
            max_wait_seconds=req_int(d, "max_wait_seconds", where),
            legacy_atomic_mapping=legacy,
            waits=(
                None
                if d.get("waits") is None
                else WaitPolicy.from_dict(req_map(d, "waits", where), f"{where}.waits")
            ),
            admission=(
                None
                if d.get("admission") is None
                else AdmissionPolicy.from_dict(d["admission"], f"{where}.admission")
            ),
        )


# ------------------------------------------------------------------ bundle


@dataclass(frozen=True)
class SubflowSource:
    """The immutable source of one Flow version a Subflow element may call."""

    api_name: str
    version: int
    source: Mapping[str, Any]


@dataclass(frozen=True)
class CompilerInputs:
    """Everything a compile depends on besides the Flow source itself (§7.1)."""

    binding: RuntimeWorkBindingRef
    catalog: CatalogGenerationRef
    entries: tuple[CapabilityEntryView, ...]
    metadata_view: MetadataViewInput
    policy: RuntimePolicy
    subflows: tuple[SubflowSource, ...] = ()

    def entries_for(self, action_type: str) -> tuple[CapabilityEntryView, ...]:
        """Every entry for ``action_type`` (more than one is a catalog conflict)."""
        return tuple(e for e in self.entries if e.action_type == action_type)

    def subflow(self, api_name: str, version: int) -> SubflowSource | None:
        """The source of ``api_name`` version ``version``, or ``None``."""
        return next(
            (s for s in self.subflows if s.api_name == api_name and s.version == version), None
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompilerInputs:
        """Decode one JSON bundle.

        Shape: ``{"binding", "catalog": {"generation", "entries"}, "metadata_view",
        "policy", "subflows": [<Flow document>, ...]}``.
        """
        catalog = req_map(d, "catalog", "inputs")
        entries = tuple(
            CapabilityEntryView.from_dict(e, f"catalog.entries[{i}]")
            for i, e in enumerate(req_seq(catalog, "entries", "catalog", default_empty=True))
        )
        subflows = []
        for i, s in enumerate(req_seq(d, "subflows", "inputs", default_empty=True)):
            if not isinstance(s, Mapping):
                raise FieldError(f"inputs.subflows[{i}]: expected an object")
            subflows.append(
                SubflowSource(
                    api_name=req_str(s, "api_name", f"inputs.subflows[{i}]"),
                    version=req_int(s, "version", f"inputs.subflows[{i}]"),
                    source=s,
                )
            )
        return cls(
            binding=RuntimeWorkBindingRef.from_dict(req_map(d, "binding", "inputs")),
            catalog=CatalogGenerationRef.from_dict(req_map(catalog, "generation", "catalog")),
            entries=entries,
            metadata_view=MetadataViewInput.from_dict(req_map(d, "metadata_view", "inputs")),
            policy=RuntimePolicy.from_dict(req_map(d, "policy", "inputs")),
            subflows=tuple(subflows),
        )
