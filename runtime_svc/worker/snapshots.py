"""Snapshot-read verification tokens (§7.5 ``VerifiedSnapshotRead``, §12.2 step 6).

A ``VerifiedSnapshotRead`` step records one :class:`ReadToken` per record it read
(object, record id, record version; ``None`` when the record was absent) in its output
checkpoint's ``ReadVerificationSet``. The set is carried forward unchanged through every
later checkpoint, keyed by the plan step that took the snapshot, so the mutation step that
``verifies`` that snapshot (``PlanStep.verifies``) finds the tokens in its *input*
checkpoint however many steps (pure compute, decisions) lie between them.

The verifying mutation re-reads every token's record ``FOR UPDATE`` inside its business
transaction — after its declared business locks, before any business write and before the
lifecycle fence — and raises :class:`SnapshotChangedError` when a version moved or the
record vanished (deleted or absent), which rolls the whole step back with nothing written.

Semantics of a changed snapshot (documented choice): the failure is classified
``snapshot_changed`` and is *terminal* — the step takes its compiled fault path, which for
every mutation step the compiler emits today is the ``$failed`` terminal (the worker has no
fault-handler routing yet; a fault edge to a non-terminal step fails closed the same way).
A retry from the same input checkpoint is deliberately not scheduled: it would re-verify
the same stale tokens against monotonically increasing record versions and therefore can
never succeed, so retrying would only burn the attempt budget (§12.3: churn must become a
terminal signal). Re-taking the snapshot needs a new checkpoint from the snapshot step,
which only a plan edge back to that step can express.

Own writes are not external changes: after a mutation commits, the tokens of the records
it wrote are refreshed to the versions it produced (:func:`refresh_tokens`), so a later
mutation verifying the same snapshot does not fail on the flow's own update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.records.store import read_record_txn
from runtime_svc.worker.executor import StepFault

__all__ = [
    "SNAPSHOT_CHANGED",
    "ReadToken",
    "SnapshotChangedError",
    "merge_tokens",
    "parse_set",
    "refresh_tokens",
    "tokens_for",
    "verify_tokens_txn",
]

#: Safe failure code of a snapshot whose records changed before the verifying mutation.
SNAPSHOT_CHANGED = "snapshot_changed"
_FORMAT = 1


@dataclass(frozen=True)
class ReadToken:
    """One record version a snapshot read observed (``version`` ``None``: absent)."""

    object_name: str
    record_id: str
    version: int | None

    def to_dict(self) -> dict[str, Any]:
        """Checkpoint form."""
        return {"object": self.object_name, "id": self.record_id, "version": self.version}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReadToken:
        """Inverse of :meth:`to_dict`."""
        version = d.get("version")
        return cls(str(d["object"]), str(d["id"]), None if version is None else int(version))


class SnapshotChangedError(StepFault):
    """A verified snapshot no longer matches the current records (rolls the step back)."""

    def __init__(self, token: ReadToken, found: int | None) -> None:
        super().__init__(
            SNAPSHOT_CHANGED,
            f"{token.object_name} {token.record_id}: snapshot version {token.version}, "
            f"now {'absent' if found is None else found}",
        )
        self.token = token
        self.found = found


def parse_set(raw: Any) -> dict[str, tuple[ReadToken, ...]]:
    """The snapshots of a stored ``ReadVerificationSet`` (``None``/empty: no snapshots)."""
    if not isinstance(raw, Mapping) or raw.get("format") != _FORMAT:
        return {}
    snapshots = raw.get("snapshots")
    if not isinstance(snapshots, Mapping):
        return {}
    return {
        str(key): tuple(ReadToken.from_dict(t) for t in tokens)
        for key, tokens in snapshots.items()
        if isinstance(tokens, list)
    }


def _to_set(snapshots: Mapping[str, Sequence[ReadToken]]) -> dict[str, Any] | None:
    if not snapshots:
        return None
    return {
        "format": _FORMAT,
        "snapshots": {key: [t.to_dict() for t in snapshots[key]] for key in sorted(snapshots)},
    }


def merge_tokens(
    previous: Mapping[str, Sequence[ReadToken]], step_key: str, tokens: Iterable[ReadToken]
) -> dict[str, Any] | None:
    """The output set: ``previous`` carried forward, with ``step_key``'s snapshot
    replaced by ``tokens`` (deduplicated by record, first observation wins)."""
    merged: dict[str, Sequence[ReadToken]] = dict(previous)
    seen: dict[tuple[str, str], ReadToken] = {}
    for t in tokens:
        seen.setdefault((t.object_name, t.record_id), t)
    merged[step_key] = tuple(seen.values())
    return _to_set(merged)


def refresh_tokens(
    previous: Mapping[str, Sequence[ReadToken]], written: Mapping[tuple[str, str], int]
) -> dict[str, Any] | None:
    """The output set after a committed mutation: tokens of the records it wrote carry
    the versions it produced (``written``: ``(object, id) -> version``)."""
    return _to_set(
        {
            key: tuple(
                ReadToken(t.object_name, t.record_id, written[(t.object_name, t.record_id)])
                if (t.object_name, t.record_id) in written
                else t
                for t in tokens
            )
            for key, tokens in previous.items()
        }
    )


def tokens_for(
    snapshots: Mapping[str, Sequence[ReadToken]], verifies: Iterable[str]
) -> tuple[ReadToken, ...]:
    """The tokens a mutation must verify, in canonical (object, id) order. A verified
    snapshot step with no tokens did not run on this path: nothing to verify."""
    found = {(t.object_name, t.record_id): t for key in verifies for t in snapshots.get(key, ())}
    return tuple(found[k] for k in sorted(found))


async def verify_tokens_txn(
    conn: AsyncConnection, org_id: str, tokens: Sequence[ReadToken]
) -> None:
    """Re-read every token's record under lock and compare versions.

    Raises:
        SnapshotChangedError: a version changed, or the record vanished / appeared.
    """
    for token in tokens:
        state = await read_record_txn(conn, org_id, token.object_name, token.record_id, lock=True)
        found = None if state is None or state.is_deleted else state.version
        if found != token.version:
            raise SnapshotChangedError(token, found)
