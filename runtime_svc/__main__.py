"""``python -m runtime_svc [serve | db upgrade|verify|current]``: the runtime service process."""

from __future__ import annotations

import sys

from runtime_svc.app import build_services, start_runtime_background
from runtime_svc.outbox.table import RUNTIME_OUTBOX
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    sys.exit(
        run_service(
            ServiceName.RUNTIME,
            "runtime_svc",
            build_services,
            outbox=RUNTIME_OUTBOX,
            background=start_runtime_background,
        )
    )
