"""``python -m runtime_svc [serve | db upgrade|verify|current]``: the runtime service process."""

from __future__ import annotations

import sys

from runtime_svc.app import RuntimeApp
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    app = RuntimeApp()
    sys.exit(
        run_service(
            ServiceName.RUNTIME,
            "runtime_svc",
            app.build_services,
            background=app.start_background,
        )
    )
