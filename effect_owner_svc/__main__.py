"""``python -m effect_owner_svc [serve | db …]``: the effect-owner service process."""

from __future__ import annotations

import sys

from effect_owner_svc.app import build_services, start_owner_background
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    sys.exit(
        run_service(
            ServiceName.EFFECT_OWNER,
            "effect_owner_svc",
            build_services,
            background=start_owner_background,
        )
    )
