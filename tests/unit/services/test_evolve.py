"""``services.evolve.evolve`` is ``dataclasses.replace`` — field for field on the
kernel's records, and by falling back to ``replace`` wherever copying the instance's
dictionary could differ from running ``__init__``."""

from __future__ import annotations

import dataclasses
import functools
from datetime import UTC, datetime
from typing import Any

import pytest

from runtime_svc.kernel.model import AttemptRecord, RunRecord, StepRecord
from services.evolve import evolve

_NOW = datetime(2026, 12, 4, 8, 0, tzinfo=UTC)


def _sample(cls: type) -> Any:
    values: dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        values[f.name] = f"{f.name}-{i}"
    return cls(**values)


@pytest.mark.parametrize("cls", [RunRecord, StepRecord, AttemptRecord])
def test_evolve_equals_replace_on_the_kernels_records(cls: type) -> None:
    record = _sample(cls)
    first, last = dataclasses.fields(cls)[0].name, dataclasses.fields(cls)[-1].name
    changes = {first: "changed", last: _NOW}
    evolved = evolve(record, **changes)
    assert evolved == dataclasses.replace(record, **changes)
    assert type(evolved) is cls and evolved is not record
    assert getattr(record, first) == f"{first}-0"  # the original is untouched
    assert evolve(record) == record


def test_an_unknown_field_is_refused_as_replace_refuses_it() -> None:
    record = _sample(RunRecord)
    with pytest.raises(TypeError, match="no_such_field"):
        evolve(record, no_such_field=1)
    with pytest.raises(TypeError):
        dataclasses.replace(record, no_such_field=1)
    with pytest.raises(TypeError):
        evolve(object())


@dataclasses.dataclass(frozen=True)
class _Checked:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


@dataclasses.dataclass(frozen=True)
class _Derived:
    n: int
    double: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "double", 2 * self.n)


@dataclasses.dataclass(frozen=True, slots=True)
class _Slotted:
    n: int


@dataclasses.dataclass(frozen=True)
class _Cached:
    n: int

    @functools.cached_property
    def square(self) -> int:
        return self.n * self.n


@dataclasses.dataclass(frozen=True)
class _HandWritten:
    n: int

    def __init__(self, n: int) -> None:
        object.__setattr__(self, "n", abs(n))


def test_classes_whose_init_does_more_than_assign_go_through_replace() -> None:
    with pytest.raises(ValueError, match="negative"):
        evolve(_Checked(1), n=-1)  # __post_init__ still checks
    assert evolve(_Derived(2), n=5).double == 10  # and still derives
    assert evolve(_Slotted(1), n=3) == _Slotted(3)
    assert evolve(_HandWritten(1), n=-4).n == 4  # the class's own __init__ ran
    cached = _Cached(3)
    assert cached.square == 9
    assert evolve(cached, n=4).square == 16  # a cached value is not carried over
