"""§22.2 "no Flow-specific visibility/tombstone field exists" (§10.1: ``IsDeleted`` is the
single public-visibility fact; ``DeleteRequestedAt`` is lifecycle evidence only).

Pure: the SQLAlchemy models of every service, and the legacy owner's reads and delete.
"""

from __future__ import annotations

import importlib
import inspect
import re

from runtime_svc.legacy import model, store
from runtime_svc.migration import prebridge

_SERVICES = ("runtime_svc", "catalog_svc", "effect_owner_svc")
_VISIBILITY = re.compile(r"visib|tombstone|hidden|archiv|purged|deleted|soft_del", re.IGNORECASE)
#: The one visibility fact, and the one lifecycle time that is not a visibility field.
_ALLOWED = {"is_deleted", "delete_requested_at"}


def test_no_table_has_a_second_visibility_or_tombstone_field() -> None:
    offenders = []
    for service in _SERVICES:
        metadata = importlib.import_module(f"{service}.schema").metadata
        for table in metadata.sorted_tables:
            offenders += [
                f"{service}.{table.name}.{c.name}"
                for c in table.columns
                if _VISIBILITY.search(c.name) and c.name not in _ALLOWED
            ]
    assert offenders == []


def test_the_legacy_owner_hides_and_deletes_through_is_deleted_only() -> None:
    reads = inspect.getsource(store.LegacyInterviewStore.get_txn)
    assert "t.is_deleted.is_(False)" in reads
    due = inspect.getsource(store.LegacyInterviewStore.due_list)
    assert "t.is_deleted.is_(False)" in due
    delete = inspect.getsource(model.decide_delete) + inspect.getsource(model._cancel_values)
    assert '"is_deleted": True' in delete
    assert not [
        n for n in re.findall(r'"(\w+)"', delete) if _VISIBILITY.search(n) and n not in _ALLOWED
    ]
    assert "row.is_deleted" in inspect.getsource(prebridge.read_prebridge_interview)
