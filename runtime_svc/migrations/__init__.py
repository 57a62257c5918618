"""Alembic migration environment of runtime_svc (see services.migrate)."""
