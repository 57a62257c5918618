"""Admission budgets of the versioned runtime policy (§16.2, §16.3): pure, no I/O.

The ``admission`` section of an org's runtime-policy document (a new generation on every
change, like every other bound) holds the budgets admission enforces before a business
connection is acquired::

    "admission": {
      "org":            {"max_inflight": 8, "weight": 1},
      "lanes":          {"durable_mutation": {"max_inflight": 6, "weight": 4}},
      "profiles":       {"durable_orchestration": {"max_inflight": 6}},
      "flows":          {"Invoice_Sync": {"max_inflight": 2, "max_concurrent_runs": 3}},
      "flow_versions":  {"Invoice_Sync@4": {"max_inflight": 1}},
      "object_classes": {"Account": {"max_inflight": 4}},
      "records":        {"Account": {"max_concurrent_runs": 1}},
      "reserved_share": 0.25,
      "pressure": {"pool_saturation": 0.75, "retry_rate": 0.2, ...}
    }

* ``max_inflight`` — step executions admitted at once in that scope (per runtime
  process: admission is decided locally, from local signals, without a shared counter);
* ``weight`` — the scope's share in the deficit scheduler (org) and lane order (lane);
* ``max_concurrent_runs`` (flows only) — runs of the Flow that may be *started*
  (claimed at least once, not terminal) at once, across every process: a durable,
  fenced slot count (:mod:`runtime_svc.admission.slots`);
* ``records.<Object>.max_concurrent_runs`` — runs *about one record* of that object (the
  record whose save started them) that may be started and not terminal at once, across
  every process and every Flow: durable slots keyed by the record;
* ``reserved_share`` — the fraction of the environment budget mutation admission can
  never take: cold lanes, dependency completions and recovery keep it under pressure;
* ``pressure`` — the thresholds at which each signal counts as full pressure
  (:class:`~runtime_svc.admission.pressure.PressureThresholds`).

The *environment* budget is the deployment's: the runtime process's connection pool
(``FLOW_DB_POOL_SIZE``) bounds what admission may hand out, see
:class:`~runtime_svc.admission.controller.AdmissionController`.

An absent section (or key) is unbounded at that scope; the section is left out of the
canonical form when absent, so documents written before it existed keep their digest.
:meth:`AdmissionPolicy.bound_for` is the applicable bound — the smallest of every scope a
subject falls in, with the scope that set it — which activation diagnostics show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_PRESSURE",
    "AdmissionPolicy",
    "AdmissionSubject",
    "AppliedBound",
    "Budget",
    "PressureThresholds",
    "admission_notes",
]


def _int(d: Mapping[str, Any], key: str, where: str, *, low: int) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}.{key} must be an integer >= {low}")
    return value


def _rate(d: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}.{key} must be a number > 0")
    return float(value)


def _unknown(d: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    extra = sorted(set(d) - set(known))
    if extra:
        raise ValueError(f"{where}: unknown field(s) {', '.join(extra)}")


@dataclass(frozen=True)
class Budget:
    """One scope's budget (``None``: unbounded in that dimension)."""

    max_inflight: int | None = None
    weight: int = 1
    max_concurrent_runs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"weight": self.weight}
        if self.max_inflight is not None:
            out["max_inflight"] = self.max_inflight
        if self.max_concurrent_runs is not None:
            out["max_concurrent_runs"] = self.max_concurrent_runs
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str, *, runs: bool = False) -> Budget:
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be an object")
        keys = ("max_inflight", "weight", *(("max_concurrent_runs",) if runs else ()))
        _unknown(d, keys, where)
        return cls(
            max_inflight=_int(d, "max_inflight", where, low=0),
            weight=_int(d, "weight", where, low=1) or 1,
            max_concurrent_runs=_int(d, "max_concurrent_runs", where, low=1) if runs else None,
        )


def _records(raw: Any, where: str) -> dict[str, int]:
    """The ``records`` table: object name -> ``max_concurrent_runs`` (>= 1)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object")
    out: dict[str, int] = {}
    for name, value in raw.items():
        at = f"{where}.{name}"
        if not isinstance(value, Mapping):
            raise ValueError(f"{at} must be an object")
        _unknown(value, ("max_concurrent_runs",), at)
        limit = _int(value, "max_concurrent_runs", at, low=1)
        if limit is None:
            raise ValueError(f"{at}.max_concurrent_runs is required")
        out[str(name)] = limit
    return out


@dataclass(frozen=True)
class PressureThresholds:
    """The value of each §16.2 signal that counts as *full* pressure (1.0).

    A signal is no pressure below half its threshold and full pressure (1.0) at it; the
    controller reduces new mutation admissions by the largest one. Rates are per admitted
    attempt (a retry rate of 0.2 means one attempt in five ended in a retry) over the
    controller's window.
    """

    active_mutations: float = 16
    pool_saturation: float = 0.75
    lock_wait_rate: float = 0.2
    deadlock_rate: float = 0.1
    retry_rate: float = 0.3
    queue_age_seconds: float = 300
    lease_expiry_rate: float = 0.1

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> PressureThresholds:
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be an object")
        default = cls()
        _unknown(d, default.to_dict(), where)
        values = {k: _rate(d, k, where, v) for k, v in default.to_dict().items()}
        if values["pool_saturation"] > 1:
            raise ValueError(f"{where}.pool_saturation must be <= 1")
        return cls(**values)


DEFAULT_PRESSURE = PressureThresholds()


@dataclass(frozen=True)
class AdmissionSubject:
    """What one admission decision is about: the scopes a candidate step falls in."""

    org_id: str
    lane: str
    profile: str = ""
    flow_api_name: str = ""
    flow_version: int = 0
    object_classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AppliedBound:
    """The applicable ``max_inflight`` of a subject and the scope that set it."""

    limit: int | None
    scope: str

    def describe(self) -> str:
        if self.limit is None:
            return "unbounded by the org's admission policy"
        return f"at most {self.limit} in flight ({self.scope})"


@dataclass(frozen=True)
class AdmissionPolicy:
    """The ``admission`` section of a runtime-policy generation (module docstring)."""

    org: Budget = field(default_factory=Budget)
    lanes: Mapping[str, Budget] = field(default_factory=dict)
    profiles: Mapping[str, Budget] = field(default_factory=dict)
    flows: Mapping[str, Budget] = field(default_factory=dict)
    flow_versions: Mapping[str, Budget] = field(default_factory=dict)
    object_classes: Mapping[str, Budget] = field(default_factory=dict)
    #: Per-record run limits by object name (``max_concurrent_runs``).
    records: Mapping[str, int] = field(default_factory=dict)
    reserved_share: float = 0.25
    pressure: PressureThresholds = DEFAULT_PRESSURE

    def __post_init__(self) -> None:
        # Imported here: the compiler's RuntimePolicy imports this module.
        from runtime_svc.compiler.kinds import ExecutionProfile, QueueClass

        if not 0 <= self.reserved_share < 1:
            raise ValueError("admission.reserved_share must be in [0, 1)")
        lanes = {q.value for q in QueueClass}
        for name in self.lanes:
            if name not in lanes:
                raise ValueError(f"admission.lanes: unknown lane {name!r}")
        profiles = {p.value for p in ExecutionProfile}
        for name in self.profiles:
            if name not in profiles:
                raise ValueError(f"admission.profiles: unknown profile {name!r}")
        for key in self.flow_versions:
            api, _, version = key.rpartition("@")
            if not api or not version.isdigit():
                raise ValueError(f"admission.flow_versions: {key!r} is not '<FlowApiName>@<n>'")

    # --- decisions -----------------------------------------------------------------------

    def lane_weight(self, lane: str) -> int:
        budget = self.lanes.get(lane)
        return budget.weight if budget is not None else 1

    def concurrent_runs_limit(self, flow_api_name: str) -> int | None:
        """The per-Flow run concurrency limit (``None``: none)."""
        budget = self.flows.get(flow_api_name)
        return None if budget is None else budget.max_concurrent_runs

    def record_runs_limit(self, object_name: str) -> int | None:
        """The per-record run concurrency limit of ``object_name`` (``None``: none)."""
        return self.records.get(object_name)

    def scopes(self, subject: AdmissionSubject) -> list[tuple[str, Budget]]:
        """Every budget ``subject`` falls in, with its scope key (for in-flight counting)."""
        found: list[tuple[str, Budget]] = [("org", self.org)]
        pairs: list[tuple[str, Budget | None]] = [
            (f"lane:{subject.lane}", self.lanes.get(subject.lane)),
            (f"profile:{subject.profile}", self.profiles.get(subject.profile)),
            (f"flow:{subject.flow_api_name}", self.flows.get(subject.flow_api_name)),
            (
                f"flow_version:{subject.flow_api_name}@{subject.flow_version}",
                self.flow_versions.get(f"{subject.flow_api_name}@{subject.flow_version}"),
            ),
            *((f"object:{o}", self.object_classes.get(o)) for o in subject.object_classes),
        ]
        found.extend((k, b) for k, b in pairs if b is not None)
        return found

    def bound_for(self, subject: AdmissionSubject) -> AppliedBound:
        """The smallest ``max_inflight`` of every scope of ``subject`` (its scope named)."""
        best = AppliedBound(None, "")
        for key, budget in self.scopes(subject):
            limit = budget.max_inflight
            if limit is not None and (best.limit is None or limit < best.limit):
                best = AppliedBound(limit, key)
        return best

    # --- canonical form ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def table(t: Mapping[str, Budget]) -> dict[str, Any]:
            return {k: t[k].to_dict() for k in sorted(t)}

        out: dict[str, Any] = {
            "org": self.org.to_dict(),
            "lanes": table(self.lanes),
            "profiles": table(self.profiles),
            "flows": table(self.flows),
            "flow_versions": table(self.flow_versions),
            "object_classes": table(self.object_classes),
            "reserved_share": self.reserved_share,
            "pressure": self.pressure.to_dict(),
        }
        if self.records:
            # Only when set: documents published before the key keep their digest.
            out["records"] = {
                k: {"max_concurrent_runs": self.records[k]} for k in sorted(self.records)
            }
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "admission") -> AdmissionPolicy:
        """Decode and validate (absent keys take the defaults).

        Raises:
            ValueError: a malformed section (the message names the offending key).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be an object")
        default = cls()
        _unknown(d, (*default.to_dict(), "records"), where)

        def table(key: str, runs: bool = False) -> dict[str, Budget]:
            raw = d.get(key, {})
            if not isinstance(raw, Mapping):
                raise ValueError(f"{where}.{key} must be an object")
            return {
                str(k): Budget.from_dict(v, f"{where}.{key}.{k}", runs=runs) for k, v in raw.items()
            }

        share = d.get("reserved_share", default.reserved_share)
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise ValueError(f"{where}.reserved_share must be a number")
        return cls(
            org=Budget.from_dict(d.get("org", {}), f"{where}.org"),
            lanes=table("lanes"),
            profiles=table("profiles"),
            flows=table("flows", runs=True),
            flow_versions=table("flow_versions"),
            object_classes=table("object_classes"),
            records=_records(d.get("records", {}), f"{where}.records"),
            reserved_share=float(share),
            pressure=PressureThresholds.from_dict(d.get("pressure", {}), f"{where}.pressure"),
        )


def admission_notes(
    policy: AdmissionPolicy,
    org_id: str,
    flow_api_name: str,
    flow_version: int,
    profile: str,
    lanes: Iterable[str],
    object_classes: Iterable[str],
) -> list[tuple[str, str]]:
    """``(path, message)`` of the admission bounds that apply to a plan, one per lane it
    uses plus its per-Flow run concurrency limit — what activation diagnostics show
    (§16.3: "activation diagnostics show the applicable bound")."""
    objects = tuple(sorted(set(object_classes)))
    notes: list[tuple[str, str]] = []
    for lane in sorted(set(lanes)):
        bound = policy.bound_for(
            AdmissionSubject(org_id, lane, profile, flow_api_name, flow_version, objects)
        )
        notes.append((f"admission.lanes[{lane}]", f"lane {lane}: {bound.describe()}"))
    runs = policy.concurrent_runs_limit(flow_api_name)
    notes.append(
        (
            f"admission.flows[{flow_api_name}]",
            "concurrent runs: "
            + ("unlimited" if runs is None else f"at most {runs} (admission.flows)"),
        )
    )
    return notes
