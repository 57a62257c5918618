"""``python -m runtime_svc [serve | db upgrade|verify|current]``: the runtime service process."""

from __future__ import annotations

import logging
import sys

from runtime_svc.app import build_services, start_runtime_background
from runtime_svc.migration.protocol import BinaryRefusedError
from services.config import ServiceName
from services.service_main import run_service


def main() -> int:
    """Serve; a binary the deployment control record refuses exits 3 before serving."""
    try:
        return run_service(
            ServiceName.RUNTIME,
            "runtime_svc",
            build_services,
            background=start_runtime_background,
        )
    except BinaryRefusedError as exc:
        logging.getLogger("runtime_svc").error("refusing to start: %s", exc.safe_message)
        return 3


if __name__ == "__main__":
    sys.exit(main())
