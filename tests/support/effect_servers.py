"""Real local servers for the effect tests, counting what they receive:

* :class:`ScriptedMailSink` — the dev SMTP sink (``flowctl.mailsink``) with scripted
  replies per message (accept, 4xx, 5xx, or "store, then drop the connection before the
  reply": the provider accepted but its response is lost);
* :class:`WebhookReceiver` — a tiny HTTP/1.1 server honouring ``Idempotency-Key``: it
  counts requests and, separately, distinct effects; scripted replies per request
  (status codes, or "apply, then drop the connection"); ``GET /status`` answers the
  lookup contract of the webhook provider;
* :class:`FakeWakeSignals` — a ``WakeSignalService`` stand-in for the runtime's receiving
  side, served over real gRPC with the production bootstrap (credential verification):
  deduplicates on (scope, producer kind, key, token) exactly as the contract says, and
  can lose its response after committing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from flowctl.mailsink import MailSink, start_mail_sink
from services.auth import current_identity
from services.effect_contract import WAKE_SIGNAL_SUBMIT_ROLE, wake_evidence_digest
from services.errors import PermissionDeniedError
from services.proto import runtime_v1

__all__ = [
    "DROP",
    "FakeWakeSignals",
    "ScriptedMailSink",
    "WebhookReceiver",
    "mail_sink",
    "webhook_receiver",
]

#: Script entry: perform/store the effect, then close the connection without replying.
DROP = "drop"


@dataclass
class ScriptedMailSink(MailSink):
    """``replies``: one entry per DATA command (``"250"`` default, ``"451"``, ``"550"``,
    :data:`DROP`); a 4xx/5xx reply stores nothing."""

    replies: list[str] = field(default_factory=list)
    data_commands: int = 0
    #: SMTP sessions opened (``EHLO`` commands), to see connection reuse.
    sessions: int = 0
    _open: list[Any] = field(default_factory=list)

    async def handle_EHLO(
        self, server: Any, session: Any, envelope: Any, hostname: str, responses: list[str]
    ) -> list[str]:
        self.sessions += 1
        session.host_name = hostname
        self._open.append(server)
        return responses

    def drop_sessions(self) -> None:
        """Close every session from the server side (an idle timeout, a restart)."""
        for server in self._open:
            if server.transport is not None:
                server.transport.close()
        self._open.clear()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.data_commands += 1
        reply = self.replies.pop(0) if self.replies else "250"
        if reply == "451":
            return "451 Requested action aborted: try again later"
        if reply == "550":
            return "550 Requested action not taken: mailbox unavailable"
        self.accept(envelope)
        if reply == DROP:
            server.transport.close()
        return "250 Message accepted for delivery"


@contextlib.asynccontextmanager
async def mail_sink(sink: ScriptedMailSink) -> AsyncIterator[int]:
    """Serve ``sink`` on a free loopback port; yields the port."""
    server = await start_mail_sink(sink)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


@dataclass
class WebhookReceiver:
    """See the module docstring. ``replies``: per POST, an int status or :data:`DROP`."""

    replies: list[int | str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    effects: dict[str, Any] = field(default_factory=dict)
    lookups: int = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            key = headers.get("idempotency-key", "")
            if method == "GET" and path.startswith("/status"):
                self.lookups += 1
                if key in self.effects:
                    await self._reply(writer, 200, {"outcome": "succeeded"})
                else:
                    await self._reply(writer, 404, {"outcome": "unknown"})
                return
            self.requests.append({"path": path, "key": key, "body": json.loads(body or b"{}")})
            reply = self.replies.pop(0) if self.replies else 200
            if reply == DROP or (isinstance(reply, int) and 200 <= reply < 300):
                # Honour Idempotency-Key: the effect happens once per key.
                self.effects.setdefault(key, json.loads(body or b"{}"))
            if reply == DROP:
                return  # the effect happened; the response is lost
            await self._reply(writer, int(reply), {"ok": 200 <= int(reply) < 300})
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()


@contextlib.asynccontextmanager
async def webhook_receiver(receiver: WebhookReceiver) -> AsyncIterator[str]:
    """Serve ``receiver`` on a free loopback port; yields its base URL."""
    server = await asyncio.start_server(receiver._handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@dataclass
class FakeWakeSignals(runtime_v1.WakeSignalServiceServicer):  # type: ignore[misc]
    """Receiving side of the completion-receipt contract (see the module docstring).

    ``lose_responses``: how many of the next calls commit and then answer UNAVAILABLE.
    ``unavailable``: how many of the next calls fail before committing.
    """

    signals: dict[tuple[str, ...], Any] = field(default_factory=dict)
    calls: int = 0
    lose_responses: int = 0
    unavailable: int = 0

    async def SubmitWakeSignal(self, request: Any, context: Any) -> Any:
        self.calls += 1
        identity = current_identity()
        if WAKE_SIGNAL_SUBMIT_ROLE not in identity.roles:
            raise PermissionDeniedError("role missing", reason="role_missing")
        scope = identity.require_work_scope()
        if self.unavailable > 0:
            self.unavailable -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        if request.evidence_json and wake_evidence_digest(request.evidence_json) != (
            request.evidence_digest
        ):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "evidence digest")
        key = (
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
            request.producer_kind,
            request.producer_key,
            request.wake_token,
        )
        duplicate = key in self.signals
        if not duplicate:
            self.signals[key] = request
        if self.lose_responses > 0:
            self.lose_responses -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "response lost")
        signal = runtime_v1.WakeSignal(
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            wake_signal_id=f"sig-{len(self.signals)}",
            producer_kind=request.producer_kind,
            producer_key=request.producer_key,
            wake_token=request.wake_token,
            wake_version=request.wake_version,
            evidence_digest=request.evidence_digest,
        )
        return runtime_v1.SubmitWakeSignalResponse(signal=signal, duplicate=duplicate)
