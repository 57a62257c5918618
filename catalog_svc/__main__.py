"""``python -m catalog_svc [serve | db upgrade|verify|current]``: the catalog service process."""

from __future__ import annotations

import sys

from catalog_svc.app import build_services, start_catalog_background
from services.config import ServiceName
from services.service_main import run_service

if __name__ == "__main__":
    sys.exit(
        run_service(
            ServiceName.CATALOG,
            "catalog_svc",
            build_services,
            background=start_catalog_background,
        )
    )
