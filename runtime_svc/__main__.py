"""``python -m runtime_svc [serve | worker | db upgrade|verify|current]``: the runtime process.

``serve`` (the default) serves the runtime RPCs and runs the background loops the
``FLOW_RUNTIME_WORKERS``/``FLOW_RUNTIME_SWEEPS`` role flags ask for; ``worker`` runs only
those loops (its gRPC server answers health and reflection), for worker-only replicas.
"""

from __future__ import annotations

import sys

from runtime_svc.app import RuntimeApp
from runtime_svc.outbox.table import RUNTIME_OUTBOX
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    app = RuntimeApp()
    sys.exit(
        run_service(
            ServiceName.RUNTIME,
            "runtime_svc",
            app.build_services,
            outbox=RUNTIME_OUTBOX,
            background=app.start_background,
            state_sources=app.state_sources,
        )
    )
