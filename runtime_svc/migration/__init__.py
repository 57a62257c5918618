"""The §20 migration contract: the write-protocol bridge and its gates, the trusted org
backfill, the writer fleet, cohorts, reconciliation, shadow comparison, rollback and
release evidence. The legacy owner itself lives in :mod:`runtime_svc.legacy`.

Import the submodules directly; this package re-exports nothing so that the kernel can
import :mod:`runtime_svc.migration.protocol` without a cycle.
"""

__all__: list[str] = []
