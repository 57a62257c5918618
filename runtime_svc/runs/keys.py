"""Idempotency keys of runs as stored (``flow_runs.idempotency_key``, unique per org).

The store dedupes on ``(org, key)``; ``StartRun`` promises at most one run per
``(org, flow_api_name, idempotency_key)`` and after-save triggers derive their key from
the record mutation, so both are namespaced here and can never collide with each other.
Pure.
"""

from __future__ import annotations

from services.digest import versioned_digest
from services.errors import InvalidArgumentError

__all__ = [
    "MAX_CALLER_KEY_LEN",
    "after_save_key",
    "caller_key",
    "start_key",
]

MAX_CALLER_KEY_LEN = 100
_START = "start/"
_AFTER_SAVE = "after-save/"


def start_key(flow_api_name: str, idempotency_key: str) -> str:
    """Stored key of a caller-supplied ``StartRun`` key.

    Raises:
        InvalidArgumentError: the key is longer than :data:`MAX_CALLER_KEY_LEN`.
    """
    if len(idempotency_key) > MAX_CALLER_KEY_LEN:
        raise InvalidArgumentError(
            f"idempotency_key is longer than {MAX_CALLER_KEY_LEN} characters",
            field_path="idempotency_key",
        )
    # The API name is hashed so long names cannot push the key past the column bound.
    return (
        _START
        + versioned_digest("start-run-key", [flow_api_name, idempotency_key])[-40:]
        + ("/" + idempotency_key)
    )


def after_save_key(
    org_id: str,
    object_name: str,
    record_id: str,
    history_sequence: int,
    flow_api_name: str,
) -> str:
    """Stored key of the run an after-save subscription starts for one record mutation.

    A replayed record transaction has the same (object, record, history sequence), so it
    maps to the same key and the store returns the run it already started.
    """
    digest = versioned_digest(
        "after-save-run-key",
        [org_id, object_name, record_id, history_sequence, flow_api_name],
    )
    return _AFTER_SAVE + digest


def caller_key(stored: str | None) -> str:
    """The key a client supplied (``""`` for none or a derived trigger key)."""
    if stored is None or not stored.startswith(_START):
        return ""
    return stored.split("/", 2)[2]
