"""Checkpoint payload validation (§5.4.6, §10.4, §17.3): size bound and no credentials.

A checkpoint is durable Flow context; no bearer token, password or credential may ever
be persisted in it. :func:`validate_checkpoint_payload` walks the JSON value and rejects

* a field whose *name* denotes credential material (``password``, ``api_key``,
  ``Authorization``, ``client_secret``, ``sessionId``, ``x-auth-token``, …; matched on
  the name's words, case-insensitively, at any depth), and
* a string (value or key) that *looks like* a credential: ``Bearer``/``Basic``
  authorization values, ``nfw1.`` workload credentials, JWT-shaped ``eyJ….….…``
  tokens, PEM private-key blocks, AWS access-key ids, ``password=``-style query
  parameters and ``scheme://user:password@`` URLs,

with an :class:`~services.errors.InvalidArgumentError` whose ``field_path`` is the payload
field plus the JSON path of the first offender (``context_payload.customer.password``;
the message says ``$.customer.password``). The message and attributes name
paths and rule codes only — never the value; a key that itself looks like a credential
is shown as ``[<redacted key>]``. The serialized size is bounded before anything else.

Pure: no I/O, no proto or SQLAlchemy import.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.digest import CanonicalJsonError, canonical_json
from services.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "CheckpointViolation",
    "find_credential_material",
    "validate_checkpoint_payload",
]

#: Default bound of one serialized checkpoint context (the column holds up to 1 MiB).
DEFAULT_MAX_CHECKPOINT_BYTES = 256 * 1024
#: Paths listed in one error (the first is also ``field_path``).
_MAX_REPORTED = 10
#: Nesting bound: deeper values are rejected rather than walked recursively forever.
_MAX_DEPTH = 64

# Words that name credential material wherever they occur in a field name.
_SECRET_WORDS = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "secret",
        "secrets",
        "authorization",
        "apikey",
        "privatekey",
        "clientsecret",
        "sessionid",
        "accesstoken",
        "refreshtoken",
        "idtoken",
        "authtoken",
        "secretkey",
        "accesskey",
        "setcookie",
    }
)
# Words that name credential material when they end the name (``session_cookie``,
# ``github_token``, ``x-auth-token``) but not when qualified (``cookie_consent``,
# ``token_count``).
_SECRET_LAST_WORDS = frozenset(
    {"token", "cookie", "cookies", "credential", "credentials", "pwd", "bearer"}
)
# Two adjacent words that name credential material together (``api_key``, ``sessionId``).
_SECRET_PAIRS = frozenset(
    {
        ("api", "key"),
        ("private", "key"),
        ("client", "secret"),
        ("session", "id"),
        ("session", "key"),
        ("access", "key"),
        ("secret", "key"),
        ("signing", "key"),
        ("set", "cookie"),
        ("auth", "header"),
    }
)

_WORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

#: Value patterns: (rule code, regex).
_VALUE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("bearer_token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*")),
    ("basic_credentials", re.compile(r"(?i)\bbasic\s+[A-Za-z0-9+/]{12,}={0,2}")),
    ("workload_credential", re.compile(r"nfw1\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")),
    ("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")),
    ("private_key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("aws_access_key", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "credential_parameter",
        re.compile(
            r"(?i)(?:^|[?&;\s])(?:password|passwd|pwd|secret|client_secret|api_?key|"
            r"access_token|refresh_token|id_token|auth_token|token|session_?id)=[^&;\s]+"
        ),
    ),
    ("url_credentials", re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")),
)


@dataclass(frozen=True)
class CheckpointViolation:
    """One finding: where (JSON path) and which rule — never the offending value."""

    path: str
    rule: str


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(name)]


def _name_rule(name: str) -> str | None:
    words = _words(name)
    if not words:
        return None
    if "".join(words) in _SECRET_WORDS or any(w in _SECRET_WORDS for w in words):
        return "credential_field"
    if any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words)):
        return "credential_field"
    if words[-1] in _SECRET_LAST_WORDS:
        return "credential_field"
    return None


def _value_rule(text: str) -> str | None:
    return next((rule for rule, pattern in _VALUE_PATTERNS if pattern.search(text)), None)


_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _child_path(path: str, key: str, *, redact: bool) -> str:
    if redact:  # the key itself matched a value rule: never echo it
        return f"{path}[<redacted key>]"
    if _IDENT_RE.match(key):
        return f"{path}.{key}"
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    return f'{path}["{escaped}"]'


#: Distinct field names whose rules are memoized (:func:`_key_rules`).
_MAX_CACHED_KEYS = 4096


@functools.lru_cache(maxsize=_MAX_CACHED_KEYS)
def _key_rules(key: str) -> tuple[str | None, str | None, str]:
    """The rules of one field name — its value rule (a key that looks like a credential),
    its name rule, and its path suffix — memoized: the same names recur in every step's
    context (issue 13). Pure functions of ``key``, so a cached answer is the answer."""
    key_rule = _value_rule(key)
    suffix = _child_path("", key, redact=key_rule is not None)
    return key_rule, _name_rule(key), suffix


def _carries_nothing(value: Any) -> bool:
    # A declared-but-empty field or a flag (``has_password: true``) holds no credential.
    return value is None or isinstance(value, bool) or value in ("", [], {})


def _walk(value: Any, path: str, depth: int) -> Iterator[CheckpointViolation]:
    if depth > _MAX_DEPTH:
        yield CheckpointViolation(path, "too_deep")
        return
    if isinstance(value, str):
        rule = _value_rule(value)
        if rule is not None:
            yield CheckpointViolation(path, rule)
    elif isinstance(value, Mapping):
        for key, child in value.items():
            key_rule, name_rule, suffix = _key_rules(str(key))
            child_path = path + suffix
            if key_rule is not None:
                yield CheckpointViolation(child_path, key_rule)
                continue
            if name_rule is not None and not _carries_nothing(child):
                yield CheckpointViolation(child_path, name_rule)
                continue
            yield from _walk(child, child_path, depth + 1)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        for index, child in enumerate(value):
            yield from _walk(child, f"{path}[{index}]", depth + 1)


def _clean(value: Any, depth: int) -> bool:
    """``value`` holds nothing :func:`_walk` would report — the same rules, answered
    without building a path or a generator per node (a step's checkpoint is checked on
    every commit, issue 13); :func:`_walk` then runs only to name what was found."""
    if depth > _MAX_DEPTH:
        return False
    kind = type(value)
    if kind is str:
        return _value_rule(value) is None
    if kind is dict or (kind is not list and isinstance(value, Mapping)):
        for key, child in value.items():
            key_rule, name_rule, _ = _key_rules(str(key))
            if key_rule is not None:
                return False
            if name_rule is not None and not _carries_nothing(child):
                return False
            if not _clean(child, depth + 1):
                return False
        return True
    if kind is list or (
        isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)
    ):
        return all(_clean(child, depth + 1) for child in value)
    if isinstance(value, str):  # a str subclass
        return _value_rule(value) is None
    return True


def find_credential_material(value: Any, *, root: str = "$") -> list[CheckpointViolation]:
    """Every credential-looking field name or value in ``value``, in document order.

    A credential-named field whose value is empty (``null``, ``""``, ``[]``, ``{}``) or
    a boolean carries no credential and is allowed, so a schema may declare the field.
    """
    if _clean(value, 0):
        return []
    return list(_walk(value, root, 0))


def validate_checkpoint_payload(
    value: Any,
    *,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
    field: str = "context_payload",
) -> bytes:
    """Validate a checkpoint payload and return its canonical JSON bytes.

    Args:
        value: the JSON value (context or plan cursor).
        max_bytes: bound of the canonical serialization.
        field: name of the payload in errors (``field_path`` starts with it).

    Raises:
        InvalidArgumentError: no canonical JSON form (``checkpoint_not_json``), larger than
            ``max_bytes`` (``checkpoint_too_large``), or credential material
            (``checkpoint_credential_rejected``; ``field_path`` is ``field`` followed by the
            first offending JSON path, e.g. ``context_payload.customer.password``).
    """
    try:
        data = canonical_json(value)
    except CanonicalJsonError:
        raise InvalidArgumentError(
            f"{field} is not JSON", reason="checkpoint_not_json", field_path=field
        ) from None
    if len(data) > max_bytes:
        raise InvalidArgumentError(
            f"{field} is {len(data)} bytes; the bound is {max_bytes}",
            reason="checkpoint_too_large",
            field_path=field,
            attributes={"size_bytes": str(len(data)), "max_bytes": str(max_bytes)},
        )
    found = find_credential_material(value, root="$")
    if found:
        shown = found[:_MAX_REPORTED]
        raise InvalidArgumentError(
            f"{field} contains credential material at {shown[0].path} ({shown[0].rule}); "
            "checkpoints may not persist credentials",
            reason="checkpoint_credential_rejected",
            field_path=field + shown[0].path[1:],
            attributes={
                "paths": ",".join(v.path for v in shown),
                "rules": ",".join(v.rule for v in shown),
                "count": str(len(found)),
            },
        )
    return data
