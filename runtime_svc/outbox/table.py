"""The canonical Runtime outbox (``runtime_outbox``, §10.7) as a generic outbox table.

The primary key and the dedupe key carry the complete trusted work scope; the dedupe key
is ``(scope, message_family, effect_handoff_key)``; ``deadline`` bounds handoff
convergence (§15.4).
"""

from __future__ import annotations

from runtime_svc.schema import runtime_outbox
from services.db import WORK_SCOPE
from services.outbox import OutboxTable

__all__ = ["RUNTIME_OUTBOX"]

RUNTIME_OUTBOX = OutboxTable(
    table=runtime_outbox,
    id_column="runtime_outbox_message_id",
    key_column="effect_handoff_key",
    pk_scope_columns=WORK_SCOPE,
    dedupe_scope_columns=WORK_SCOPE,
    deadline_column="deadline",
)
