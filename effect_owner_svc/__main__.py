"""``python -m effect_owner_svc [serve | db …]``: the effect-owner service process."""

from __future__ import annotations

import sys

from effect_owner_svc.app import OwnerApp, state_sources
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    app = OwnerApp()
    sys.exit(
        run_service(
            ServiceName.EFFECT_OWNER,
            "effect_owner_svc",
            app.build_services,
            outbox=OWNER_OUTBOX,
            background=app.start_background,
            state_sources=state_sources,
        )
    )
