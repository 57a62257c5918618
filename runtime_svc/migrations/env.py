"""Alembic environment of the runtime service (driven by ``services.migrate``)."""

from __future__ import annotations

from runtime_svc.schema import metadata
from services.migrate import run_migrations

run_migrations(metadata)
