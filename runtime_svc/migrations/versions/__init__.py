"""Alembic revisions of runtime_svc; Alembic loads them by file, never by import."""
