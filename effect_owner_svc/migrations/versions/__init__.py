"""Alembic revisions of effect_owner_svc; Alembic loads them by file, never by import."""
