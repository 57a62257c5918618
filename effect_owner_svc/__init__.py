"""Effect-owner service: idempotent inbox with the accept/reject fence, external commands, receipts."""
