"""The email provider: SMTP through ``aiosmtplib`` (the demo's ``crm.send_email``).

Payload (schema version 1, frozen by the runtime, no credentials)::

    {"to": "a@example.com" | ["a@…", …],            required, at most 50 addresses
     "subject": "…", "text": "…",                     or ("body" is accepted for "text")
     "template": "contact_welcome", "params": {…}}    a built-in template

A Flow's ``ActionCall`` inputs become the payload one to one, so any other top-level
scalar input (``"name": "Ada Lovelace"``) is a template parameter too (``params`` wins).

The command's provider idempotency key becomes the message's ``Message-ID``
(``<key@domain>``), the same on every attempt, so any receiving system that
deduplicates on Message-ID sees one message; SMTP itself offers no lookup and does not
deduplicate, so this provider is *not* ``replay_safe``: an attempt whose outcome is
unknown is quarantined by the dispatcher, never sent again blindly.

Classification follows the SMTP conversation phase (RFC 5321): anything before the
``DATA`` payload was transmitted proves nothing was accepted (connection refused, 4xx →
``FAILED_RETRYABLE``; 5xx → ``FAILED_TERMINAL``); a 250 reply to the data is
``SUCCEEDED``; a 4xx/5xx reply to the data is a definite refusal; a timeout or a dropped
connection after the data was sent is ``OUTCOME_UNKNOWN`` (the server may have queued it).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from email.message import EmailMessage
from email.utils import formatdate
from types import MappingProxyType
from typing import Any

import aiosmtplib

from effect_owner_svc.providers.base import ProviderCommand, ProviderOutcome
from services.config import SmtpSettings

__all__ = ["TEMPLATES", "EmailPayloadError", "EmailProvider", "build_message"]

_ADDRESS_RE = re.compile(r"^[^@\s<>,;\"]{1,64}@[A-Za-z0-9.-]{1,253}$")
_MAX_RECIPIENTS = 50
_MAX_TEXT = 64 * 1024
#: Payload keys with a meaning of their own (never template parameters).
_RESERVED = frozenset({"to", "subject", "text", "body", "template", "params"})

#: Built-in templates: subject and body with ``$param`` placeholders.
TEMPLATES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "contact_welcome": (
            "Welcome, ${name}!",
            "Hello ${name},\n\nwelcome aboard — we are glad to have you.\n\n-- Nexus Flow\n",
        ),
    }
)


class EmailPayloadError(ValueError):
    """The payload is not a valid email request (a permanent failure)."""


def _recipients(raw: Any) -> list[str]:
    values = [raw] if isinstance(raw, str) else raw
    if not isinstance(values, list) or not values or len(values) > _MAX_RECIPIENTS:
        raise EmailPayloadError("'to' must be one address or a list of 1-50 addresses")
    for v in values:
        if not isinstance(v, str) or not _ADDRESS_RE.match(v):
            raise EmailPayloadError("'to' holds a malformed address")
    return list(values)


def _subject_and_text(payload: Mapping[str, Any], to: list[str]) -> tuple[str, str]:
    template = payload.get("template")
    if template is not None:
        if template not in TEMPLATES:
            raise EmailPayloadError("unknown template")
        params = payload.get("params", {})
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, str | int | float) for k, v in params.items()
        ):
            raise EmailPayloadError("'params' must map names to scalars")
        inputs = {
            k: v
            for k, v in payload.items()
            if k not in _RESERVED and isinstance(v, str | int | float) and not isinstance(v, bool)
        }
        values = {
            "name": to[0].split("@", 1)[0],
            **{k: str(v) for k, v in inputs.items() if str(v).strip()},
            **{k: str(v) for k, v in params.items()},
        }
        subject, body = TEMPLATES[template]
        return (
            string.Template(subject).safe_substitute(values),
            string.Template(body).safe_substitute(values),
        )
    plain_subject = payload.get("subject")
    plain_text = payload.get("text", payload.get("body"))
    if not isinstance(plain_subject, str) or not isinstance(plain_text, str):
        raise EmailPayloadError("give 'subject' and 'text', or a 'template'")
    return plain_subject, plain_text


def build_message(
    command: ProviderCommand, *, sender: str, message_id_domain: str
) -> tuple[EmailMessage, list[str]]:
    """The RFC 5322 message of a command and its recipients.

    Raises:
        EmailPayloadError: the payload is not a valid email request.
    """
    payload = command.payload
    to = _recipients(payload.get("to"))
    subject, text = _subject_and_text(payload, to)
    if "\n" in subject or "\r" in subject or len(subject) > 998:
        raise EmailPayloadError("the subject must be one line")
    if len(text.encode("utf-8")) > _MAX_TEXT:
        raise EmailPayloadError("the text is too long")
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = ", ".join(to)
    msg["Subject"] = subject
    msg["Date"] = formatdate(usegmt=True)
    msg["Message-ID"] = f"<{command.idempotency_key}@{message_id_domain}>"
    msg["X-Nexus-Flow-Command"] = command.command_id
    msg.set_content(text)
    return msg, to


def _code_class(exc: aiosmtplib.SMTPResponseException) -> str:
    return "4xx" if 400 <= exc.code < 500 else "5xx"


class EmailProvider:
    """SMTP submission for one configured server (see the module docstring)."""

    name = "email"
    replay_safe = False

    def __init__(self, settings: SmtpSettings, *, password: str | None = None) -> None:
        self._settings = settings
        self._password = password
        domain = settings.sender.rsplit("@", 1)[-1] if "@" in settings.sender else "localhost"
        self._domain = domain or "localhost"

    def _client(self) -> aiosmtplib.SMTP:
        s = self._settings
        return aiosmtplib.SMTP(
            hostname=s.host,
            port=s.port,
            timeout=s.timeout_s,
            start_tls=s.starttls,  # False: never STARTTLS (no opportunistic upgrade)
            username=s.username or None,
            password=self._password if s.username else None,
        )

    async def submit(self, command: ProviderCommand) -> ProviderOutcome:
        try:
            message, to = build_message(
                command, sender=self._settings.sender, message_id_domain=self._domain
            )
        except EmailPayloadError:
            return ProviderOutcome.terminal("invalid_email_payload")
        client = self._client()
        try:
            return await self._converse(client, message, to)
        finally:
            try:
                await client.quit()
            except Exception:
                client.close()

    async def _converse(
        self, client: aiosmtplib.SMTP, message: EmailMessage, to: list[str]
    ) -> ProviderOutcome:
        # Phase 1: nothing of the message has been transmitted.
        try:
            await client.connect()
            await client.mail(self._settings.sender)
        except aiosmtplib.SMTPAuthenticationError:
            return ProviderOutcome.terminal("smtp_auth_failed")
        except aiosmtplib.SMTPResponseException as exc:
            if 400 <= exc.code < 500:
                return ProviderOutcome.retryable("smtp_sender_4xx")
            return ProviderOutcome.terminal("smtp_sender_5xx")
        except (aiosmtplib.SMTPException, OSError):
            return ProviderOutcome.retryable("smtp_unavailable")
        accepted, temporary = [], 0
        for rcpt in to:
            try:
                await client.rcpt(rcpt)
                accepted.append(rcpt)
            except aiosmtplib.SMTPResponseException as exc:
                temporary += 1 if _code_class(exc) == "4xx" else 0
            except (aiosmtplib.SMTPException, OSError):
                return ProviderOutcome.retryable("smtp_unavailable")
        if not accepted:
            if temporary:
                return ProviderOutcome.retryable("smtp_recipients_4xx")
            return ProviderOutcome.terminal("smtp_recipients_refused")
        # Phase 2: the message is being transmitted; only a reply is definite.
        try:
            await client.data(message.as_bytes())
        except aiosmtplib.SMTPResponseException as exc:
            if 400 <= exc.code < 500:
                return ProviderOutcome.retryable("smtp_data_4xx")
            return ProviderOutcome.terminal("smtp_data_5xx")
        except (aiosmtplib.SMTPException, OSError):
            return ProviderOutcome.unknown("smtp_data_unacknowledged")
        return ProviderOutcome.succeeded(
            message_id=str(message["Message-ID"]),
            accepted_recipients=len(accepted),
            refused_recipients=len(to) - len(accepted),
        )

    async def lookup(self, idempotency_key: str) -> ProviderOutcome | None:
        """SMTP has no lookup."""
        del idempotency_key
        return None

    async def aclose(self) -> None:
        """Connections are per submission; nothing is pooled."""
        return None
