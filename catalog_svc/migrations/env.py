"""Alembic environment of the catalog service (driven by ``services.migrate``)."""

from __future__ import annotations

from catalog_svc.schema import metadata
from services.migrate import run_migrations

run_migrations(metadata)
