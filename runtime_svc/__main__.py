"""``python -m runtime_svc [serve | worker | db upgrade|verify|current]``: the runtime process.

``serve`` (the default) serves the runtime RPCs and runs the background loops the
``FLOW_RUNTIME_WORKERS``/``FLOW_RUNTIME_SWEEPS`` role flags ask for; ``worker`` runs only
those loops (its gRPC server answers health and reflection), for worker-only replicas.
A binary the deployment control record refuses (§20.3) exits 3 before serving.
"""

from __future__ import annotations

import logging
import sys

from runtime_svc.app import RuntimeApp
from runtime_svc.migration.protocol import BinaryRefusedError
from runtime_svc.outbox.table import RUNTIME_OUTBOX
from services.config import ServiceName
from services.service_main import run_service


def main() -> int:
    """Serve; a binary the deployment control record refuses exits 3 before serving."""
    app = RuntimeApp()
    try:
        return run_service(
            ServiceName.RUNTIME,
            "runtime_svc",
            app.build_services,
            outbox=RUNTIME_OUTBOX,
            background=app.start_background,
            state_sources=app.state_sources,
        )
    except BinaryRefusedError as exc:
        logging.getLogger("runtime_svc").error("refusing to start: %s", exc.safe_message)
        return 3


if __name__ == "__main__":
    sys.exit(main())
