"""Effect-owner service: inbox with the accept/reject fence, external commands, receipts."""
