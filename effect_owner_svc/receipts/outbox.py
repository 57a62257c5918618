"""The effect owner's producer outbox (``owner_outbox``) as a generic outbox table.

Completion receipts travel through it to the runtime's ``WakeSignalService`` (§15.2);
the message key is the receipt's wake token (``<command_id>/<outcome_version>``), unique
per org and family, so a receipt is enqueued once.
"""

from __future__ import annotations

from effect_owner_svc.schema import owner_outbox
from services.outbox import OutboxTable

__all__ = ["OWNER_OUTBOX"]

OWNER_OUTBOX = OutboxTable(
    table=owner_outbox,
    id_column="owner_outbox_message_id",
    key_column="message_key",
)
