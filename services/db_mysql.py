"""The MariaDB/MySQL backend's connection: no ROLLBACK round trip when the pool takes
back a connection whose transaction already ended.

SQLAlchemy's pool resets every connection it takes back with a ROLLBACK (reset on
return), so every committed transaction costs one more round trip to the server. The
server reports with every reply whether the session is inside a transaction
(``SERVER_STATUS_IN_TRANS`` of the OK/EOF packet, kept by the driver as
``server_status``); after a COMMIT or ROLLBACK it is not, and then the reset's ROLLBACK
is a no-op on the server. This adapter skips exactly that one: whenever the driver's
last reply says a transaction is open — a statement ran and nothing ended it, an error
interrupted it, or the session state is unknown — the ROLLBACK is sent as before.

``services.db`` passes :func:`reset_aware_dbapi` as the engine's DBAPI module
(``create_async_engine(module=…)``), so nothing outside our engines changes.
"""

from __future__ import annotations

from typing import Any

import aiomysql
import pymysql
from sqlalchemy.dialects.mysql.aiomysql import (
    AsyncAdapt_aiomysql_connection,
    AsyncAdapt_aiomysql_dbapi,
)
from sqlalchemy.util.concurrency import await_

__all__ = ["reset_aware_dbapi"]

#: ``SERVER_STATUS_IN_TRANS`` (MySQL protocol): the session has an open transaction.
_IN_TRANS = 1


class _ResetAwareConnection(AsyncAdapt_aiomysql_connection):
    """``rollback()`` is a no-op when the server's last reply says no transaction is
    open (see the module docstring)."""

    __slots__ = ()

    def rollback(self) -> None:
        status = getattr(self._connection, "server_status", None)
        if isinstance(status, int) and not status & _IN_TRANS:
            return  # the server said: no transaction open — ROLLBACK would do nothing
        super().rollback()


class _ResetAwareDbapi(AsyncAdapt_aiomysql_dbapi):
    """SQLAlchemy's ``aiomysql`` DBAPI shim whose connections are reset-aware."""

    def connect(self, *arg: Any, **kw: Any) -> AsyncAdapt_aiomysql_connection:
        creator_fn = kw.pop("async_creator_fn", self.aiomysql.connect)
        return await_(_ResetAwareConnection.create(self, creator_fn(*arg, **kw)))


def reset_aware_dbapi() -> Any:
    """The DBAPI module for ``create_async_engine(module=…)`` of a MySQL-protocol engine."""
    return _ResetAwareDbapi(aiomysql, pymysql)
