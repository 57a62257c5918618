"""A local SMTP sink (``aiosmtpd``) for development and tests: every message it accepts
is counted and, when a directory is given, written there as one ``.eml`` file.

``make run`` starts it as a child (``python -m flowctl.mailsink --dir ./.data/mail
--port $FLOW_EFFECT_SMTP_PORT``) and points the effect owner's email provider at it, so
the demo's welcome e-mail can be opened from ``./.data/mail/``. Tests run the same
handler in their own event loop (:func:`start_mail_sink`) and count messages at the
server, never at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email
import email.policy
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP

__all__ = ["MailSink", "ReceivedMail", "main", "start_mail_sink"]

log = logging.getLogger("mailsink")

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ReceivedMail:
    """One accepted message."""

    mail_from: str
    rcpt_tos: tuple[str, ...]
    message_id: str
    subject: str
    data: bytes


@dataclass
class MailSink:
    """The aiosmtpd handler (``handle_DATA``)."""

    directory: Path | None = None
    received: list[ReceivedMail] = field(default_factory=list)

    def _write(self, mail: ReceivedMail, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        stem = _SAFE.sub("_", mail.message_id.strip("<>"))[:80] or "message"
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{len(self.received):05d}-{stem}.eml"
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(mail.data)
        os.replace(tmp, directory / name)  # a reader never sees half a message
        return directory / name

    def accept(self, envelope: Any) -> ReceivedMail:
        data = envelope.original_content or envelope.content or b""
        if isinstance(data, str):
            data = data.encode("utf-8")
        parsed = email.message_from_bytes(data, policy=email.policy.default)
        mail = ReceivedMail(
            mail_from=str(envelope.mail_from or ""),
            rcpt_tos=tuple(str(r) for r in envelope.rcpt_tos),
            message_id=str(parsed.get("Message-ID", "")),
            subject=str(parsed.get("Subject", "")),
            data=bytes(data),
        )
        self.received.append(mail)
        if self.directory is not None:
            path = self._write(mail, self.directory)
            log.info("mail for %s -> %s", ", ".join(mail.rcpt_tos), path)
        return mail

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.accept(envelope)
        return "250 Message accepted for delivery"


async def start_mail_sink(handler: Any, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Serve ``handler`` over SMTP on ``host:port`` (0 picks a free port) in this loop."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: SMTP(handler, hostname="nexus-mail-sink", loop=loop), host, port
    )


async def _serve(directory: Path, host: str, port: int) -> None:
    server = await start_mail_sink(MailSink(directory), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()
    log.info("mail sink listening on %s:%s, writing to %s", bound[0], bound[1], directory)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowctl.mailsink")
    parser.add_argument("--dir", required=True, type=Path, help="where .eml files go")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s mailsink: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.dir, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
