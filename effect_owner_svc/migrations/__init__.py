"""Alembic migration environment of effect_owner_svc (see services.migrate)."""
