"""Process logging set-up with credential redaction.

Code never logs metadata or credentials (ARCHITECTURE §3). As a second line of
defence the formatter installed here masks anything that looks like a workload
credential or a bearer token in the *formatted* record, tracebacks included.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

__all__ = ["RedactingFormatter", "configure_logging", "redact"]

_CREDENTIAL_RE = re.compile(r"nfw1\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_BEARER_RE = re.compile(r"(?i)\b(bearer\s+)[^\s'\",)]+")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def redact(text: str) -> str:
    """``text`` with workload credentials and bearer tokens masked."""
    return _BEARER_RE.sub(r"\1<redacted>", _CREDENTIAL_RE.sub("nfw1.<redacted>", text))


class RedactingFormatter(logging.Formatter):
    """A formatter whose output passes through :func:`redact`."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str, *, stream: TextIO | None = None) -> None:
    """Log one line per record at ``level`` to ``stream`` (default stderr), redacted.

    Replaces the root handlers, so calling it twice does not duplicate output.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(RedactingFormatter(_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
