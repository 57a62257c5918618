"""Canonical JSON and versioned SHA-256 digests.

This is the one implementation behind every digest the spec names
(``RuntimeWorkBindingDigest``, descriptor digest, ``BindingFingerprint``,
``EntryDigest``, ``CatalogDigest``, ``PlanDigest``, ``TriggerBindingDigest``,
``ContextDigest``, ``PayloadDigest``, lease-token digests, …).

A digest string is self-describing::

    <kind>/v<version>:sha256:<64 lowercase hex>

and the hashed bytes are domain-separated: ``b"nexus.flow/<kind>/v<version>\\n"``
followed by the canonical JSON of the value, so two different kinds (or two
versions of one kind's canonical form) can never collide even for equal
payloads.

Canonical JSON: UTF-8, object keys sorted by code point, no insignificant
white space, no NaN/Infinity, strings as-is (no ASCII escaping), tuples encoded
as arrays, ``IntEnum``/``StrEnum`` values encoded by value. Only ``str`` keys are
allowed. Anything else (bytes, sets, arbitrary objects) is rejected, because a
value without one canonical form cannot be digested deterministically.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

__all__ = [
    "DIGEST_RE",
    "CanonicalJsonError",
    "canonical_json",
    "digest_bytes",
    "is_digest",
    "parse_digest",
    "versioned_digest",
]

DIGEST_RE = re.compile(
    r"^(?P<kind>[a-z][a-z0-9_.-]*)/v(?P<version>[1-9][0-9]*):sha256:(?P<hex>[0-9a-f]{64})$"
)
_KIND_RE = re.compile(r"^[a-z][a-z0-9_.-]*$")


class CanonicalJsonError(ValueError):
    """The value has no canonical JSON form."""


def _normalize(value: Any, path: str) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, Enum):
        return _normalize(value.value, path)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CanonicalJsonError(f"{path}: non-finite float has no canonical form")
        if value == 0.0:
            return 0.0  # fold -0.0
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CanonicalJsonError(f"{path}: object key {k!r} is not a string")
            out[k] = _normalize(v, f"{path}.{k}")
        return out
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return [_normalize(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise CanonicalJsonError(f"{path}: {type(value).__name__} has no canonical JSON form")


class _General(Exception):
    """:func:`_plain` met a value only :func:`_normalize` handles."""


def _plain(value: Any) -> Any:
    """:func:`_normalize` for values built of exact ``dict`` (``str`` keys), ``list``,
    ``tuple``, ``str``, ``int``, ``bool``, finite ``float`` and ``None`` — the common
    case — with the same result, without the ABC checks or the error paths it builds
    per element; anything else raises :class:`_General` (the caller then normalizes the
    whole value the general way, which also names the offending path)."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is dict:
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _General
            out[k] = _plain(v)
        return out
    if kind is list or kind is tuple:
        return [_plain(v) for v in value]
    if kind is float:
        if not math.isfinite(value):
            raise _General
        return 0.0 if value == 0.0 else value  # fold -0.0
    raise _General


#: The encoder of :func:`canonical_json`, built once (``json.dumps`` with these options
#: builds an identical one per call: a third of the cost of a small value).
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes (see module docstring)."""
    try:
        normalized = _plain(value)
    except _General:
        normalized = _normalize(value, "$")
    return _ENCODER.encode(normalized).encode("utf-8")


def digest_bytes(kind: str, data: bytes, *, version: int = 1) -> str:
    """Versioned, domain-separated SHA-256 over raw bytes."""
    if not _KIND_RE.match(kind):
        raise ValueError(f"invalid digest kind {kind!r}")
    if version < 1:
        raise ValueError("digest version must be >= 1")
    h = hashlib.sha256()
    h.update(f"nexus.flow/{kind}/v{version}\n".encode())
    h.update(data)
    return f"{kind}/v{version}:sha256:{h.hexdigest()}"


def versioned_digest(kind: str, value: Any, *, version: int = 1) -> str:
    """Digest of the canonical JSON of ``value`` under ``kind`` and ``version``.

    Example:
        >>> a = versioned_digest("binding", {"b": 1, "a": 2})
        >>> a == versioned_digest("binding", {"a": 2, "b": 1})
        True
    """
    return digest_bytes(kind, canonical_json(value), version=version)


def is_digest(value: str, kind: str | None = None) -> bool:
    """True when ``value`` is a well-formed digest string (of ``kind``, if given)."""
    m = DIGEST_RE.match(value)
    return m is not None and (kind is None or m.group("kind") == kind)


def parse_digest(value: str) -> tuple[str, int, str]:
    """Split a digest string into ``(kind, version, hex)``.

    Raises:
        ValueError: the string is not a digest.
    """
    m = DIGEST_RE.match(value)
    if m is None:
        raise ValueError(f"not a digest: {value!r}")
    return m.group("kind"), int(m.group("version")), m.group("hex")
