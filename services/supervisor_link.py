"""Messages from a supervisor to its supervised child processes, over the child's stdin.

A supervised child (``python -m <service> worker --supervised``, started by
``services.process_pool``) already owns a pipe from its supervisor as stdin: its
end-of-file means "drain now" (the supervisor stopped or died). The same pipe carries
small newline-delimited JSON messages the other way round, e.g. the runtime's
"this run was just made runnable" hint (``runtime_svc.app``): a wait resolved in the API
process reaches an idle worker process at once instead of at its next poll.

Messages are hints only — the child re-validates everything through its normal fenced
paths, so a lost, duplicated or stale message costs at most a poll or a read. Hence the
bounds: a message longer than :data:`MAX_MESSAGE_BYTES` or that is not a JSON object is
dropped (logged), and a supervisor never blocks on a child that does not read (see
:meth:`services.process_pool.ProcessPool.send`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "MAX_MESSAGE_BYTES",
    "LineDecoder",
    "SupervisorMessages",
    "encode_message",
]

log = logging.getLogger(__name__)

#: The longest message line (a hint names a few ids; anything longer is not ours).
MAX_MESSAGE_BYTES = 4096


@runtime_checkable
class SupervisorMessages(Protocol):
    """A child's background duties that act on messages from the supervisor."""

    def on_supervisor_message(self, message: Mapping[str, Any]) -> None:
        """Act on one message (a hint: must not raise for an unknown or stale one)."""


def encode_message(message: Mapping[str, Any]) -> bytes:
    """One message as a line (compact JSON + ``\\n``).

    Raises:
        ValueError: the encoded message exceeds :data:`MAX_MESSAGE_BYTES`.
    """
    line = json.dumps(dict(message), separators=(",", ":"), sort_keys=True).encode() + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a supervisor message is at most {MAX_MESSAGE_BYTES} bytes")
    return line


class LineDecoder:
    """Splits the bytes read from stdin into messages (pure; bounded memory)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False  # inside an oversized line: drop until its newline

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The complete messages ``data`` finished (malformed ones dropped, logged)."""
        out: list[dict[str, Any]] = []
        self._buf.extend(data)
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_MESSAGE_BYTES:
                    self._buf.clear()
                    self._skipping = True
                return out
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if self._skipping:
                self._skipping = False
                log.warning("dropped an oversized supervisor message")
                continue
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict) or len(line) > MAX_MESSAGE_BYTES:
                log.warning("dropped a malformed supervisor message (%d bytes)", len(line))
                continue
            out.append(message)
