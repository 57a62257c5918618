"""Alembic environment of the effect-owner service (driven by ``services.migrate``)."""

from __future__ import annotations

from effect_owner_svc.schema import metadata
from services.migrate import run_migrations

run_migrations(metadata)
