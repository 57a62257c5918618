"""``dataclasses.replace`` without its per-call cost, for the hot path's frozen records.

``dataclasses.replace`` walks the class's fields, builds keyword arguments and runs the
generated ``__init__`` (for a frozen class, one ``object.__setattr__`` per field): ≈ 8 µs
for a 31-field ``RunRecord`` on the development host, several times per durable step.
:func:`evolve` copies the instance's attribute dictionary and applies the changes —
≈ 1 µs — which is exactly what ``replace`` produces for a dataclass whose ``__init__``
only assigns its fields: every field in ``__init__``, no ``__post_init__`` (nothing to
re-check or derive), no ``__slots__``, nothing but its fields in the instance's
dictionary. For anything else it *is* ``dataclasses.replace``.
An unknown field name raises ``TypeError`` as ``replace`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["evolve"]

T = TypeVar("T")

#: Per class: its field names when :func:`evolve` may copy instances, else ``None``.
_PLAIN: dict[type, frozenset[str] | None] = {}


def _plain_fields(cls: type) -> frozenset[str] | None:
    fields = dataclasses.fields(cls)
    init = getattr(cls, "__init__", None)
    if (
        # A hand-written __init__ (not the generated one) may do more than assign.
        getattr(getattr(init, "__code__", None), "co_filename", None) != "<string>"
        or hasattr(cls, "__post_init__")
        or hasattr(cls, "__slots__")
        or any(not f.init for f in fields)
    ):
        return None
    return frozenset(f.name for f in fields)


def evolve(obj: T, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)`` (see the module docstring).

    Raises:
        TypeError: ``obj`` is not a dataclass instance, or a change names no field.
    """
    cls = type(obj)
    try:
        names = _PLAIN[cls]
    except KeyError:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError("evolve() should be called on dataclass instances") from None
        names = _PLAIN[cls] = _plain_fields(cls)
    if names is None:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    state = obj.__dict__
    if len(state) != len(names):
        # The instance carries more than its fields (a cached property's
        # value, say), which ``replace`` would not carry over.
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(cls)
    copied = new.__dict__
    copied.update(state)
    copied.update(changes)
    return new
