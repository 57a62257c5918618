"""``hypothesis`` strategies for any protobuf message, built from its descriptor.

Every field gets boundary and random values of its type: empty and over-long strings
(the documented identifier limits and far beyond), control and non-ASCII characters,
integer extremes, NaN and infinities, enum numbers the proto does not define, nested
messages to a bounded depth, ``google.protobuf.Struct``/``Value`` up to nesting deeper
than any parser limit, timestamps outside the representable range, and repeated/map
fields with several entries. Fields named like a value the seeded tenant has
(``org_id``, ``plan_id``, ``flow_run_id``, …) also draw those *known* values, and a
``scope``/``binding`` field sometimes is exactly the caller's trusted one, so generated
requests get past the scope checks into the services' validation and storage paths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.protobuf import descriptor as d
from google.protobuf import json_format, struct_pb2
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

__all__ = ["Known", "deep_json", "message_strategy"]

#: Field name -> values of the seeded tenant worth drawing for it.
Known = Mapping[str, Sequence[Any]]

_MAX_DEPTH = 4
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_UINT32 = (0, 2**32 - 1)
_UINT64 = (0, 2**64 - 1)

_EDGE_STRINGS = (
    "",
    " ",
    "x" * 128,
    "x" * 129,
    "x" * 256,
    "y" * 2_000,
    "z" * 70_000,
    "\x00",
    "a\u0000b",
    "../../etc/passwd",
    "' OR '1'='1",
    "ünïcødé-名前-🙂",
    "\ud7ff",
    "\t\n\r",
    "sha256:" + "0" * 64,
    "runtime_work_binding/v1:sha256:" + "f" * 64,
    "{}",
    "[]",
    "null",
)


def deep_json(depth: int, kind: str = "list") -> str:
    """JSON nested ``depth`` levels deep (lists or objects)."""
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


_JSON_STRINGS = (
    deep_json(50),
    deep_json(5_000),
    deep_json(200_000),
    deep_json(3_000, "object"),
    '{"x": 1e999}',
    '{"x": NaN}',
    '{"a": 1, "a": 2}',
    "{" * 10 + "not json",
)


def _int_strategy(bounds: tuple[int, int]) -> st.SearchStrategy[int]:
    lo, hi = bounds
    edges = [v for v in (0, 1, -1, 2, 100, 1_000, 10**6, lo, hi, lo + 1, hi - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _json_values(max_depth: int) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.sampled_from(["", "x" * 5_000]),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.text(max_size=8), inner, max_size=3),
        ),
        max_leaves=12,
    )


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"n": value}
    return value


#: Record field names of the demo view, so generated ``Struct`` records are often valid.
RECORD_FIELDS = ("FirstName", "LastName", "Email", "Title", "Name", "AccountId", "Id")


def _record_like() -> st.SearchStrategy[dict[str, Any]]:
    values = st.one_of(
        st.text(max_size=30),
        st.sampled_from(["", "Ada", "ada@example.com", "x" * 300, "rec-1"]),
        st.none(),
        st.integers(-5, 5),
    )
    return st.dictionaries(st.sampled_from(RECORD_FIELDS), values, max_size=4)


def _struct_strategy(cls: type[Message], *, is_value: bool) -> st.SearchStrategy[Message]:
    def build(content: Any) -> Message:
        msg = cls()
        if is_value:
            msg.CopyFrom(_to_value(content))
        else:
            data = content if isinstance(content, dict) else {"v": content}
            msg.update(data)  # type: ignore[attr-defined]
        return msg

    deep = st.sampled_from([10, 25, 31]).map(_nested)
    if is_value:
        return st.one_of(_json_values(4), deep).map(build)
    return st.one_of(_record_like(), _record_like(), _json_values(4), deep).map(build)


def _to_value(content: Any) -> Message:
    value = struct_pb2.Value()
    json_format.ParseDict(content, value)
    return value


def _timestamp_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    def build(pair: tuple[int, int]) -> Message:
        msg = cls()
        msg.seconds, msg.nanos = pair  # type: ignore[attr-defined]
        return msg

    seconds = st.sampled_from([0, 1, -1, 1_700_000_000, -62_135_596_800, 253_402_300_799, 2**62])
    nanos = st.sampled_from([0, 1, 999_999_999, -1, 10**9])
    return st.tuples(seconds, nanos).map(build)


def _string_strategy(name: str, known: Known) -> st.SearchStrategy[str]:
    parts: list[st.SearchStrategy[str]] = [st.sampled_from(_EDGE_STRINGS), st.text(max_size=40)]
    if known.get(name):
        parts.insert(0, st.sampled_from(list(known[name])))
    if name == "request_id" or name.endswith("idempotency_key"):
        parts.insert(0, st.uuids().map(lambda u: f"fuzz-{u}"))
    if name.endswith("_json") or name in ("source", "flow_source", "source_json"):
        parts.insert(0, st.sampled_from(_JSON_STRINGS))
    if name.endswith("page_token"):
        parts.insert(0, st.sampled_from(["%%%", "eyJ4IjoxfQ", "A" * 10_000]))
    return st.one_of(*parts)


def _scalar_strategy(field: d.FieldDescriptor, known: Known) -> st.SearchStrategy[Any]:
    t = field.type
    if t == d.FieldDescriptor.TYPE_STRING:
        return _string_strategy(field.name, known)
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\xff" * 1_000))
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (d.FieldDescriptor.TYPE_DOUBLE, d.FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == d.FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.sampled_from([-1, 99, 2**31 - 1]))
    if t in (
        d.FieldDescriptor.TYPE_INT32,
        d.FieldDescriptor.TYPE_SINT32,
        d.FieldDescriptor.TYPE_SFIXED32,
    ):
        return _int_strategy(_INT32)
    if t in (d.FieldDescriptor.TYPE_UINT32, d.FieldDescriptor.TYPE_FIXED32):
        return _int_strategy(_UINT32)
    if t in (d.FieldDescriptor.TYPE_UINT64, d.FieldDescriptor.TYPE_FIXED64):
        return _int_strategy(_UINT64)
    return _int_strategy(_INT64)


def message_strategy(
    descriptor: d.Descriptor,
    known: Known,
    special: Mapping[str, Sequence[Message]] | None = None,
    depth: int = 0,
) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``: each field unset or drawn from its strategy.

    Args:
        descriptor: the message type.
        known: field name -> values of the seeded tenant.
        special: full message name -> ready values (the trusted scope, the binding) drawn
            for fields of that type alongside generated ones.
        depth: nesting depth (message fields beyond :data:`_MAX_DEPTH` stay unset).
    """
    special = special or {}
    cls = GetMessageClass(descriptor)
    if descriptor.full_name == "google.protobuf.Struct":
        return _struct_strategy(cls, is_value=False)
    if descriptor.full_name == "google.protobuf.Value":
        return _struct_strategy(cls, is_value=True)
    if descriptor.full_name == "google.protobuf.Timestamp":
        return _timestamp_strategy(cls)

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Message:
        msg = cls()
        for field in descriptor.fields:
            if draw(st.integers(0, 4)) == 0:  # most fields set: requests get past "required"
                continue
            _set_field(draw, msg, field, known, special, depth)
        return msg

    generated = build()
    ready = special.get(descriptor.full_name)
    if ready:
        exact = st.sampled_from(list(ready))
        return st.one_of(exact, exact, exact, generated)  # mostly the trusted value
    return generated


def _field_value(
    field: d.FieldDescriptor,
    known: Known,
    special: Mapping[str, Sequence[Message]],
    depth: int,
) -> st.SearchStrategy[Any]:
    if field.type == d.FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(field.message_type, known, special, depth + 1)
    return _scalar_strategy(field, known)


def _set_field(
    draw: Callable[[st.SearchStrategy[Any]], Any],
    msg: Message,
    field: d.FieldDescriptor,
    known: Known,
    special: Mapping[str, Sequence[Message]],
    depth: int,
) -> None:
    is_message = field.type == d.FieldDescriptor.TYPE_MESSAGE
    if is_message and depth >= _MAX_DEPTH and field.message_type.full_name not in special:
        return
    target = getattr(msg, field.name)
    if is_message and field.message_type.GetOptions().map_entry:
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        entries = draw(
            st.lists(
                st.tuples(
                    _scalar_strategy(key_field, known),
                    _field_value(value_field, known, special, depth),
                ),
                max_size=3,
            )
        )
        for key, value in entries:
            if value_field.type == d.FieldDescriptor.TYPE_MESSAGE:
                target[key].CopyFrom(value)
            else:
                target[key] = value
        return
    if field.is_repeated:
        values = draw(st.lists(_field_value(field, known, special, depth), max_size=3))
        if is_message:
            for value in values:
                target.add().CopyFrom(value)
        else:
            target.extend(values)
        return
    value = draw(_field_value(field, known, special, depth))
    if is_message:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)
