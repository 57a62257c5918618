"""Fixtures of the admission integration tests: the worker tests' migrated runtime
database per module and backend (``sqlite``, ``mariadb``), engine, shiftable clock and
kernel store."""

from __future__ import annotations

from tests.integration.kernel.conftest import kernel_db_url  # noqa: F401
from tests.integration.worker.conftest import clock, engine, store  # noqa: F401
