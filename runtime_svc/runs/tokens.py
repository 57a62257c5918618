"""Opaque, tamper-evident ``ListRuns`` page tokens.

A token carries the keyset position ``(created_at, flow_run_id)`` and is bound by an
HMAC-SHA256 to the trusted org and the filter digest: a token edited by the client,
issued to another org or for other filters is rejected (``INVALID_ARGUMENT``), never
interpreted. Pure: no SQL, no protos.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime

from services.errors import InvalidArgumentError

__all__ = ["PageCursor", "PageTokenCodec"]

_DOMAIN = b"nexus.flow.runtime.v1.ListRuns/page-token/v1"


@dataclass(frozen=True)
class PageCursor:
    """The last row of a page: the next page starts strictly after it."""

    created_at: datetime
    flow_run_id: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class PageTokenCodec:
    """Encodes/decodes page tokens under one secret.

    Args:
        secret: HMAC key; replicas serving one database must share it.
    """

    def __init__(self, secret: bytes) -> None:
        self._key = hmac.new(secret, _DOMAIN, hashlib.sha256).digest()

    def _mac(self, org_id: str, filters_digest: str, body: bytes) -> bytes:
        msg = b"\x00".join([org_id.encode(), filters_digest.encode(), body])
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def encode(self, org_id: str, filters_digest: str, cursor: PageCursor) -> str:
        """The token of the page after ``cursor``."""
        body = json.dumps(
            [cursor.created_at.isoformat(), cursor.flow_run_id], separators=(",", ":")
        ).encode()
        return f"{_b64(body)}.{_b64(self._mac(org_id, filters_digest, body))}"

    def decode(self, org_id: str, filters_digest: str, token: str) -> PageCursor | None:
        """The cursor of ``token`` (``None`` for the first page).

        Raises:
            InvalidArgumentError: malformed, edited, or issued for another org/filters.
        """
        if not token:
            return None
        try:
            body_text, mac_text = token.split(".", 1)
            body, mac = _unb64(body_text), _unb64(mac_text)
            if not hmac.compare_digest(mac, self._mac(org_id, filters_digest, body)):
                raise ValueError("mac")
            created, run_id = json.loads(body)
            return PageCursor(datetime.fromisoformat(created), str(run_id))
        except (ValueError, TypeError, binascii.Error):
            raise InvalidArgumentError(
                "page_token is malformed or was issued for other filters",
                reason="invalid_page_token",
                field_path="page_token",
            ) from None
