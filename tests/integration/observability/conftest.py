"""Fixtures of the telemetry integration tests: the durable-wait world (a migrated runtime
database per module and backend, a fresh engine and org per test)."""

from tests.integration.kernel.conftest import kernel_db_url  # noqa: F401
from tests.integration.waits.conftest import engine, world  # noqa: F401
