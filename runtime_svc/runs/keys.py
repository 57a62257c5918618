"""Idempotency keys of runs as stored (``flow_runs.idempotency_key``, unique per org).

The store dedupes on ``(org, key)``; ``StartRun`` promises at most one run per
``(complete trusted work scope, flow_api_name, idempotency_key)`` and after-save triggers
derive their key from the record mutation, so both are namespaced here and can never
collide with each other. Every component of the trusted work scope (installation,
capability, binding digest) is hashed into the stored key: two installations of one org
that use the same key get two runs and never learn of each other's (§10.0). Pure.
"""

from __future__ import annotations

from services.auth import TrustedRuntimeWorkScope
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


def _scope(scope: TrustedRuntimeWorkScope) -> list[str]:
    return [
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    ]


def start_key(scope: TrustedRuntimeWorkScope, flow_api_name: str, idempotency_key: str) -> str:
    """Stored key of a caller-supplied ``StartRun`` key within the trusted work scope.

    Raises:
        InvalidArgumentError: the key is longer than :data:`MAX_CALLER_KEY_LEN`.
    """
    if len(idempotency_key) > MAX_CALLER_KEY_LEN:
        raise InvalidArgumentError(
            f"idempotency_key is longer than {MAX_CALLER_KEY_LEN} characters",
            field_path="idempotency_key",
        )
    # Scope and API name are hashed so long values cannot push the key past the column
    # bound; the caller's key stays readable (``caller_key``).
    digest = versioned_digest("start-run-key.scoped", [*_scope(scope), flow_api_name])
    return _START + digest[-40:] + ("/" + idempotency_key)


def after_save_key(
    scope: TrustedRuntimeWorkScope,
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
        "after-save-run-key.scoped",
        [*_scope(scope), object_name, record_id, history_sequence, flow_api_name],
    )
    return _AFTER_SAVE + digest


def caller_key(stored: str | None) -> str:
    """The key a client supplied (``""`` for none or a derived trigger key)."""
    if stored is None or not stored.startswith(_START):
        return ""
    return stored.split("/", 2)[2]
