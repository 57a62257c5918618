"""Alembic migration environment of catalog_svc (see services.migrate)."""
