"""How flowctl prints: readable tables by default, JSON for scripts.

Every data command takes ``--json`` (:func:`add_output_args`): then it prints the proto
message(s) as JSON with the proto field names, exactly what ``grpcurl`` shows, so a
script can rely on the contract and not on column layout. Without it the command prints
a table (:func:`table`) or ``key: value`` lines (:func:`fields`), with enum values
shortened (``RUN_STATE_SUCCEEDED`` -> ``succeeded``) and timestamps in UTC.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

__all__ = [
    "add_output_args",
    "duration_text",
    "enum_text",
    "fields",
    "message_json",
    "print_json",
    "proto_duration_text",
    "table",
    "timestamp_text",
]


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the response as JSON (proto field names) instead of a table."""
    parser.add_argument(
        "--json", action="store_true", help="print JSON (proto field names) instead of a table"
    )


def message_json(message: Message) -> dict[str, Any]:
    """A proto message as a JSON-ready dict with the proto field names."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def print_json(value: Message | Sequence[Message] | dict[str, Any]) -> None:
    """Print one message, a list of messages or a plain dict as indented JSON."""
    if isinstance(value, Message):
        doc: Any = message_json(value)
    elif isinstance(value, dict):
        doc = value
    else:
        doc = [message_json(m) for m in value]
    print(json.dumps(doc, indent=2, ensure_ascii=False))


def enum_text(enum_type: Any, value: int) -> str:
    """``RUN_STATE_SUCCEEDED`` -> ``succeeded`` (the prefix is the enum's own name)."""
    if value == 0:
        return "-"
    name = str(enum_type.Name(value))
    prefix = "".join(("_" + c if c.isupper() else c) for c in enum_type.DESCRIPTOR.name)
    return name.removeprefix(prefix.lstrip("_").upper() + "_").lower()


def timestamp_text(ts: Timestamp) -> str:
    """ISO-8601 UTC with milliseconds, or ``-`` when unset."""
    if ts.seconds == 0 and ts.nanos == 0:
        return "-"
    moment = datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def duration_text(seconds: float) -> str:
    """``0.123s``, ``12.3s``, ``4m05s`` — short and unambiguous."""
    if seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.3f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{rest:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def proto_duration_text(d: Duration) -> str:
    """A ``google.protobuf.Duration``, or ``-`` when zero."""
    if d.seconds == 0 and d.nanos == 0:
        return "-"
    return duration_text(d.seconds + d.nanos / 1e9)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; ``(none)`` when there are no rows."""
    body = [[("-" if v is None or v == "" else str(v)) for v in row] for row in rows]
    if not body:
        return "(none)\n"
    widths = [len(h) for h in headers]
    for row in body:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.upper().ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in body]
    return "\n".join(lines) + "\n"


def fields(pairs: Iterable[tuple[str, object]]) -> str:
    """``key: value`` lines with the keys aligned; empty values print as ``-``."""
    items = [(k, "-" if v is None or v == "" else str(v)) for k, v in pairs]
    width = max((len(k) for k, _ in items), default=0)
    return "".join(f"{k + ':':<{width + 1}} {v}\n" for k, v in items)
