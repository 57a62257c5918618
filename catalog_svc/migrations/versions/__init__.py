"""Alembic revisions of catalog_svc; Alembic loads them by file, never by import."""
