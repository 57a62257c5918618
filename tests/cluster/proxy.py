"""A small TCP load balancer for the cluster tests, with a trap on the MySQL ``COMMIT``.

It stands where a production deployment puts HAProxy (or MaxScale/ProxySQL in plain TCP
mode): every new client connection goes to the first backend node that accepts it, so
once a node is dead new connections land on a live one. Existing connections are piped
byte for byte; a dead backend closes its clients' connections.

The trap makes "the node died during COMMIT" exact instead of lucky. The proxy parses
the client-to-server stream into MySQL packets (3-byte length, sequence byte, payload)
and recognises ``COM_QUERY "COMMIT"`` — what the driver sends for ``commit()`` — and a
``COM_QUERY`` whose last statement is the ``COMMIT`` its last writes carry. When
armed (:meth:`MySqlProxy.trap_next_commit`) it either

* ``forward=False``: runs the callback (which SIGKILLs the node) *before* the COMMIT
  reaches the server — the transaction certainly did not commit — then cuts the client;
* ``forward=True``: forwards the COMMIT, holds the server's answer, runs the callback
  once the answer arrived (the node committed: the write-set is certified cluster-wide)
  and cuts the client without it.

Either way the client sees its connection lost during COMMIT: an unknown outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["MySqlProxy"]

_COMMIT = b"\x03COMMIT"
#: The end of a query whose last statement is its transaction's COMMIT: the last writes
#: carry it (``services.db_batch.commit_writes``, ADR 0013/0014).
_CARRIED_COMMIT = b";\nCOMMIT"


def _commits(payload: bytes) -> bool:
    """``payload`` (a client packet's) is a COM_QUERY that sends a ``COMMIT``: alone, or
    carried by the transaction's last writes."""
    return payload == _COMMIT or (payload[:1] == b"\x03" and payload.endswith(_CARRIED_COMMIT))


#: ``SERVER_MORE_RESULTS_EXISTS`` in an OK packet's status flags.
_MORE_RESULTS = 0x0008


def _lenenc_end(payload: bytes, at: int) -> int:
    """Where the length-encoded integer at ``payload[at]`` ends."""
    first = payload[at]
    return at + {0xFC: 3, 0xFD: 4, 0xFE: 9}.get(first, 1)


def _last_answer(payload: bytes) -> bool:
    """``payload`` (a server packet's) ends the answer to a query: an ERR packet (the
    server stops a multi-statement at its first error), or an OK packet without
    ``SERVER_MORE_RESULTS_EXISTS`` — a carried ``COMMIT``'s answer comes after one OK
    packet per statement before it, each flagged that more results follow."""
    if payload[:1] == b"\xff":
        return True
    if payload[:1] != b"\x00" or len(payload) < 7:
        return False
    at = _lenenc_end(payload, _lenenc_end(payload, 1))  # affected rows, last insert id
    return not int.from_bytes(payload[at : at + 2], "little") & _MORE_RESULTS


_CONNECT_TIMEOUT_S = 2.0


@dataclass
class _Trap:
    on_commit: Callable[[], Awaitable[None]]
    forward: bool
    fired: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)  # identity-hashed: links live in a set
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    hold_reply: _Trap | None = None

    def cut(self) -> None:
        for writer in (self.client, self.server):
            transport = writer.transport
            with contextlib.suppress(Exception):
                transport.abort()


async def _fire(trap: _Trap) -> None:
    """Run the trap's callback to its end even if this link's tasks are cancelled (the
    node it kills closes the link's other direction mid-callback)."""
    task = asyncio.ensure_future(trap.on_commit())
    task.add_done_callback(lambda _: trap.fired.set())
    await asyncio.shield(task)


class MySqlProxy:
    """First-healthy-backend TCP proxy with a COMMIT trap (see the module docstring)."""

    def __init__(self, backends: Sequence[tuple[str, int]]) -> None:
        self._backends = list(backends)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._trap: _Trap | None = None
        self.port = 0
        #: Backend port each accepted connection went to, in order (test evidence).
        self.routed: list[int] = []

    async def start(self) -> MySqlProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        for link in list(self._links):
            link.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    def trap_next_commit(
        self, on_commit: Callable[[], Awaitable[None]], *, forward: bool
    ) -> asyncio.Event:
        """Arm the trap for the next ``COMMIT`` on any connection; the returned event is
        set once the callback ran."""
        self._trap = _Trap(on_commit, forward)
        return self._trap.fired

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        for host, port in self._backends:
            try:
                upstream = await asyncio.wait_for(
                    asyncio.open_connection(host, port), _CONNECT_TIMEOUT_S
                )
                self.routed.append(port)
                break
            except (OSError, TimeoutError):
                continue
        if upstream is None:
            writer.transport.abort()
            return
        link = _Link(writer, upstream[1])
        self._links.add(link)
        tasks = [
            asyncio.ensure_future(self._client_to_server(reader, link)),
            asyncio.ensure_future(self._server_to_client(upstream[0], link)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            link.cut()
            self._links.discard(link)

    async def _client_to_server(self, reader: asyncio.StreamReader, link: _Link) -> None:
        buffer = b""
        while True:
            data = await reader.read(65536)
            if not data:
                return
            buffer += data
            while len(buffer) >= 4:
                length = buffer[0] | buffer[1] << 8 | buffer[2] << 16
                if len(buffer) < 4 + length:
                    break
                packet, buffer = buffer[: 4 + length], buffer[4 + length :]
                trap = self._trap
                if trap is not None and _commits(packet[4:]):
                    self._trap = None
                    if not trap.forward:
                        await _fire(trap)
                        link.cut()
                        return
                    link.hold_reply = trap
                link.server.write(packet)
                await link.server.drain()

    async def _server_to_client(self, reader: asyncio.StreamReader, link: _Link) -> None:
        held = b""
        while True:
            data = await reader.read(65536)
            if not data:
                return
            trap = link.hold_reply
            if trap is not None:
                # Nothing more reaches the client. Once the node answered the COMMIT (the
                # last packet of the query's answer: a carried COMMIT's comes after its
                # writes'), it committed (or refused): kill it before the client hears.
                held += data
                if _answered(held):
                    await _fire(trap)
                    link.cut()
                    return
                continue
            link.client.write(data)
            await link.client.drain()


def _answered(stream: bytes) -> bool:
    """``stream`` (a server's bytes after a query) holds the query's last answer packet."""
    while len(stream) >= 4:
        length = stream[0] | stream[1] << 8 | stream[2] << 16
        if len(stream) < 4 + length:
            return False
        if _last_answer(stream[4 : 4 + length]):
            return True
        stream = stream[4 + length :]
    return False
