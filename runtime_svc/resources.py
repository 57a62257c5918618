"""Resource keys and the one persistence-owned lock order (§13.1, §13.2).

Every code path that takes row locks — ordinary record writes, Flow step commits, history
reservation, Flow lifecycle transitions, outbox and link rows — orders them with
:func:`canonical_order`, so the whole platform has one total lock order and two
transactions can never wait for each other in a cycle through keys of this order.

**Class order** (:class:`ResourceClass`, §13.1): business and parent rows → history
sequence → Flow root → Flow steps → attempts → dependencies → outbox/link rows. Derived
rows (audit records, business events, checkpoints, new outbox intents) are not locked
resources: they are fresh inserts appended after every lock is held (§5.2 rule 10).

**Parents rank with records.** A business row that is the *parent* in one lock plan can be
the mutated *record* of another (a hierarchy ``A → B → C``: writing ``C`` locks ``B`` as
parent, writing ``B`` locks it as record). Giving the two roles different ranks would give
one physical row two positions in the order and allow a cycle, so both roles are the single
class :attr:`ResourceClass.BUSINESS_RECORD` and ordered by row identity; the role is kept
beside the key in :class:`LockPlan` (:class:`LockRole`), never in the comparator.

**Normalization** (§13.2) makes the optional parts canonical (no partition is ``None``,
never ``""``) and refuses malformed keys; it never rewrites identities. Identifiers are
compared byte-for-byte by the databases (``utf8mb4_bin``), so case folding or Unicode
normalization here could merge two different rows into one lock. Python compares ``str``
by code point, which is exactly the byte order of their UTF-8 encoding, i.e. the index
order of the tables.

:func:`plan_record_mutation` is the pure lock-plan builder of one record mutation: the
record row, its lock-relevant parent rows (from the metadata view's relationships) and its
history-sequence row. Plans of several mutations combine with :meth:`LockPlan.union`.

Runtime discovery may not use map iteration, arrival order or metadata declaration order
as lock order (§13.2): :func:`canonical_order` is the only sort, and a plan whose keys are
not in canonical order cannot be built.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from runtime_svc.compiler.inputs import MetadataViewInput
from services.digest import versioned_digest
from services.errors import ConflictError

__all__ = [
    "ORDERING_VERSION",
    "LateResourceDiscoveryError",
    "LockPlan",
    "LockRole",
    "ResourceClass",
    "ResourceKey",
    "business_key",
    "canonical_order",
    "history_key",
    "is_canonical",
    "plan_record_mutation",
]

#: Version of the ordering contract implemented by :func:`canonical_order`. A key built
#: under another version cannot be ordered here (§13.1: a reordering needs a decision
#: record and mixed-binary upgrade tests), so it is refused rather than guessed.
ORDERING_VERSION = 1

#: Namespace of the business-row and history-sequence keys of records: the object API name.
_MAX_PART_LEN = 200


class ResourceClass(IntEnum):
    """Lockable resource classes in the §13.1 global order (lower value locks first).

    The gaps leave room for a future class between two existing ones; adding one still
    requires the §13.1 decision record.
    """

    #: Business rows and their lock-relevant parent rows (see the module docstring).
    BUSINESS_RECORD = 100
    #: Per-record history-sequence row, reserved only after its business rows.
    HISTORY_SEQUENCE = 200
    #: FlowRun root.
    FLOW_ROOT = 300
    #: FlowStepExecution rows, stable-ordered.
    FLOW_STEP = 400
    #: FlowStepAttempt rows.
    FLOW_ATTEMPT = 500
    #: FlowDependency rows.
    FLOW_DEPENDENCY = 600
    #: Signal/outbox disposition rows and Flow effect links.
    OUTBOX_LINK = 700


class LockRole(StrEnum):
    """Why a business row is in a plan; informative only, never part of the order."""

    RECORD = "record"
    PARENT = "parent"
    HISTORY = "history"


def _part(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"resource key {name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"resource key {name} is empty")
    if len(value) > _MAX_PART_LEN:
        raise ValueError(f"resource key {name} exceeds {_MAX_PART_LEN} characters")
    if value != value.strip():
        # Leading/trailing white space is never part of an identity here; refusing it keeps
        # "A" and "A " from becoming two locks on what a human reads as one row.
        raise ValueError(f"resource key {name} has leading or trailing white space")
    return value


@dataclass(frozen=True, slots=True)
class ResourceKey:
    """A declared resource key (§13.2); frozen, validated and normalized on construction.

    Attributes:
        resource_class: the §13.1 class.
        object_or_namespace: object API name (business/history rows) or namespace
            (``flow_run``, ``flow_step``, …).
        record_identity: stable record/parent identity within the namespace.
        partition: optional partition identity (``None`` when the class has none).
        ordering_version: the ordering contract the key was built under.
    """

    resource_class: ResourceClass
    object_or_namespace: str
    record_identity: str
    partition: str | None = None
    ordering_version: int = ORDERING_VERSION

    def __post_init__(self) -> None:
        try:
            cls = ResourceClass(self.resource_class)
        except ValueError:
            raise ValueError(f"unknown resource class {self.resource_class!r}") from None
        object.__setattr__(self, "resource_class", cls)
        _part("object_or_namespace", self.object_or_namespace)
        _part("record_identity", self.record_identity)
        if self.partition is not None:
            if self.partition == "":
                object.__setattr__(self, "partition", None)
            else:
                _part("partition", self.partition)
        version = self.ordering_version
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"ordering_version must be a positive integer, got {version!r}")

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (digests, safe diagnostics)."""
        return {
            "class": self.resource_class.name,
            "object": self.object_or_namespace,
            "identity": self.record_identity,
            "partition": self.partition,
            "ordering_version": self.ordering_version,
        }


def _sort_key(key: ResourceKey) -> tuple[int, int, str, str, int, str]:
    # The one comparator. Class rank first (§13.1), then the row identity in the byte order
    # of the tables' indexes; "no partition" sorts before every partition.
    if key.ordering_version != ORDERING_VERSION:
        raise ValueError(
            f"resource key built under ordering version {key.ordering_version}; "
            f"this comparator implements version {ORDERING_VERSION}"
        )
    return (
        int(key.resource_class),
        key.ordering_version,
        key.object_or_namespace,
        key.record_identity,
        0 if key.partition is None else 1,
        key.partition or "",
    )


def canonical_order(keys: Iterable[ResourceKey]) -> tuple[ResourceKey, ...]:
    """The keys deduplicated and in the persistence-owned total order.

    The result depends only on the *set* of keys: any permutation (or repetition) of the
    same keys gives the identical tuple.

    Raises:
        ValueError: a key was built under an ordering version this comparator does not
            implement.
    """
    return tuple(sorted(set(keys), key=_sort_key))


def is_canonical(keys: Iterable[ResourceKey]) -> bool:
    """Whether ``keys`` is already strictly increasing in the canonical order."""
    seq = tuple(keys)
    return seq == canonical_order(seq) and len(set(seq)) == len(seq)


@functools.lru_cache(maxsize=4096)
def business_key(object_name: str, record_id: str) -> ResourceKey:
    """Key of the business row ``object_name``/``record_id`` (record or parent role)."""
    return ResourceKey(ResourceClass.BUSINESS_RECORD, object_name, record_id)


@functools.lru_cache(maxsize=4096)
def history_key(object_name: str, record_id: str) -> ResourceKey:
    """Key of the history-sequence row of ``object_name``/``record_id``."""
    return ResourceKey(ResourceClass.HISTORY_SEQUENCE, object_name, record_id)


class LateResourceDiscoveryError(ConflictError):
    """A transaction needed a resource outside its admitted lock plan (§13.3).

    Raised *before* the lock is taken, so the caller rolls the whole transaction back and
    restarts it from the same input with an expanded plan (within its declared bound).
    Only the safe resource-class mismatch is sent to clients (class and object); the key
    itself stays on the exception for the caller's re-planning.
    """

    reason = "late_resource_discovery"

    def __init__(self, key: ResourceKey, role: LockRole | None = None) -> None:
        super().__init__(
            f"resource {key.resource_class.name} of {key.object_or_namespace} is not in the "
            "admitted lock plan",
            entity=key.object_or_namespace,
        )
        self.resource_key, self.role = key, role
        #: The admitted plan plus the discovered key, set by the step executor once it is
        #: proven within the step's declared bounds (the retry's expanded plan, §13.3).
        self.expanded_plan: LockPlan | None = None
        self.attributes["resource_class"] = key.resource_class.name
        if role is not None:
            self.attributes["role"] = role.value


@dataclass(frozen=True)
class LockPlan:
    """An admitted set of resource keys in canonical order.

    Attributes:
        keys: every key, deduplicated, in :func:`canonical_order`.
        roles: the role(s) each key plays (diagnostics only; never ordering).
        creates: business keys of rows this transaction inserts; their lock is taken by
            the ``INSERT`` at the key's canonical position.
    """

    keys: tuple[ResourceKey, ...] = ()
    roles: Mapping[ResourceKey, frozenset[LockRole]] = field(default_factory=dict)
    creates: frozenset[ResourceKey] = frozenset()

    def __post_init__(self) -> None:
        if not is_canonical(self.keys):
            raise ValueError("lock plan keys must be deduplicated and in canonical order")
        if set(self.roles) != set(self.keys):
            raise ValueError("lock plan roles must name exactly the plan's keys")
        if not self.creates <= set(self.keys):
            raise ValueError("every created key must be a key of the plan")
        for k in self.creates:
            if k.resource_class is not ResourceClass.BUSINESS_RECORD:
                raise ValueError("only business rows can be created under a lock plan")

    @classmethod
    def of(
        cls,
        entries: Iterable[tuple[ResourceKey, LockRole]],
        creates: Iterable[ResourceKey] = (),
    ) -> LockPlan:
        """A plan of ``(key, role)`` entries in any order (they are canonicalized)."""
        roles: dict[ResourceKey, set[LockRole]] = {}
        for key, role in entries:
            roles.setdefault(key, set()).add(role)
        created = frozenset(creates)
        for key in created:
            roles.setdefault(key, {LockRole.RECORD})
        ordered = canonical_order(roles)
        return cls(
            keys=ordered,
            roles={k: frozenset(roles[k]) for k in ordered},
            creates=created,
        )

    def __contains__(self, key: object) -> bool:
        return key in self.roles

    def union(self, other: LockPlan) -> LockPlan:
        """One plan holding the keys of both (for a transaction with several mutations)."""
        entries = [(k, r) for plan in (self, other) for k, rs in plan.roles.items() for r in rs]
        return LockPlan.of(entries, self.creates | other.creates)

    def of_class(self, resource_class: ResourceClass) -> tuple[ResourceKey, ...]:
        """The keys of one class, in canonical order."""
        return tuple(k for k in self.keys if k.resource_class is resource_class)

    def require(self, key: ResourceKey, role: LockRole | None = None) -> None:
        """Refuse a key outside the plan.

        Raises:
            LateResourceDiscoveryError: ``key`` was not admitted.
        """
        if key not in self.roles:
            raise LateResourceDiscoveryError(key, role)

    def to_dict(self) -> dict[str, Any]:
        """Canonical form."""
        return {
            "ordering_version": ORDERING_VERSION,
            "keys": [
                {**k.to_dict(), "roles": sorted(r.value for r in self.roles[k])} for k in self.keys
            ],
            "creates": [k.to_dict() for k in canonical_order(self.creates)],
        }

    def digest(self) -> str:
        """``lock-plan`` digest (what a Flow attempt records as its ``lock_plan_digest``)."""
        return versioned_digest("lock-plan", self.to_dict())


def plan_record_mutation(
    view: MetadataViewInput,
    object_name: str,
    record_id: str,
    references: Iterable[tuple[str, str | None]] = (),
    *,
    creates: bool = False,
) -> LockPlan:
    """The lock plan of one record mutation (pure).

    Args:
        view: the bound metadata view; its relationships decide which parents lock.
        object_name: object API name of the mutated record.
        record_id: identity of the mutated record.
        references: ``(lookup field, parent id)`` pairs of the record — for an update both
            the values before and after the write (a re-parenting locks both parents).
            Fields that are not the lookup of a lock-relevant relationship are ignored, as
            are ``None`` values.
        creates: the mutation inserts the record (its lock is taken by the ``INSERT``).

    Returns:
        The record row, every lock-relevant parent row and the record's history-sequence
        row, in canonical order.
    """
    record = business_key(object_name, record_id)
    entries: list[tuple[ResourceKey, LockRole]] = [
        (record, LockRole.RECORD),
        (history_key(object_name, record_id), LockRole.HISTORY),
    ]
    by_field = {
        r.field: r for r in view.relationships if r.child_object == object_name and r.lock_parent
    }
    for field_name, value in references:
        rel = by_field.get(field_name)
        if rel is None or value is None:
            continue
        parent = business_key(rel.parent_object, value)
        if parent != record:  # a self-reference is already the record's own lock
            entries.append((parent, LockRole.PARENT))
    return LockPlan.of(entries, (record,) if creates else ())
