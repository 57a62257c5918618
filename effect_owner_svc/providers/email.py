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

**Session reuse.** An SMTP session that ended a message with ``250`` is ready for the
next ``MAIL`` (RFC 5321 §4.1.4), so the provider keeps up to ``POOL_MAX`` such sessions
idle for at most ``IDLE_MAX_S`` and sends the next message on one of them — no TCP
connect, greeting, ``EHLO`` (nor ``STARTTLS``/``AUTH``) and ``QUIT`` per message. Any
other ending closes the session. A kept session the server has meanwhile dropped fails
at ``MAIL FROM`` — phase 1, before anything of the message was transmitted — and the
message is then sent on a fresh connection in the same attempt: a broken pooled
connection can neither lose a send (the retry is immediate) nor duplicate one (nothing
was sent on it); a kept session that breaks after ``DATA`` began is ``OUTCOME_UNKNOWN``
exactly like a fresh one.
"""

from __future__ import annotations

import contextlib
import email.policy
import re
import string
import time
from collections.abc import Mapping
from email.headerregistry import BaseHeader, HeaderRegistry
from email.message import EmailMessage
from email.utils import formatdate
from types import MappingProxyType
from typing import Any

import aiosmtplib

from effect_owner_svc.providers.base import ProviderCommand, ProviderOutcome, ProviderOutcomeKind
from services.config import SmtpSettings

__all__ = [
    "IDLE_MAX_S",
    "POOL_MAX",
    "TEMPLATES",
    "EmailPayloadError",
    "EmailProvider",
    "build_message",
]

#: Idle SMTP sessions kept for reuse (one per concurrent send is plenty).
POOL_MAX = 8
#: How long a kept session may sit idle (servers drop idle sessions after minutes).
IDLE_MAX_S = 30.0

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


class _CachedHeaderRegistry(HeaderRegistry):
    """The standard header registry, each header's class made once per name.

    CPython's registry builds a new class with ``type()`` on every lookup (≈ 20 µs, seven
    lookups per message here, about a third of building one); the class it builds for a
    name never differs, so keeping it changes nothing in the message."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[str, type[BaseHeader]] = {}

    def __getitem__(self, name: str) -> type[BaseHeader]:
        key = name.lower()
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = super().__getitem__(name)
        return made


#: ``email.policy.default`` (what ``EmailMessage()`` uses) with the caching registry.
_POLICY = email.policy.default.clone(header_factory=_CachedHeaderRegistry())


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
    msg = EmailMessage(policy=_POLICY)
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
        self._idle: list[tuple[aiosmtplib.SMTP, float]] = []

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
        kept = self._take()
        if kept is not None:
            outcome = await self._session(kept, message, to, reused=True)
            if outcome is not None:
                return outcome
            # The kept session was gone before anything of this message was sent.
        outcome = await self._session(self._client(), message, to, reused=False)
        if outcome is None:  # only a reused session answers "gone": a fresh one cannot
            return ProviderOutcome.retryable("smtp_unavailable")
        return outcome

    async def _session(
        self, client: aiosmtplib.SMTP, message: EmailMessage, to: list[str], *, reused: bool
    ) -> ProviderOutcome | None:
        """Converse on ``client``, then keep or close it (closed on every error and on
        cancellation — the dispatcher's call timeout — too)."""
        try:
            outcome = await self._converse(client, message, to, reused=reused)
        except BaseException:
            client.close()
            raise
        if outcome is None:
            client.close()
        else:
            await self._release(client, outcome)
        return outcome

    def _take(self) -> aiosmtplib.SMTP | None:
        """A kept session still connected and not idle too long (newest first)."""
        now = time.monotonic()
        while self._idle:
            client, since = self._idle.pop()
            if now - since <= IDLE_MAX_S and client.is_connected:
                return client
            client.close()
        return None

    async def _release(self, client: aiosmtplib.SMTP, outcome: ProviderOutcome) -> None:
        """Keep a session that ended its message with 250; close any other."""
        clean = outcome.kind is ProviderOutcomeKind.SUCCEEDED and client.is_connected
        if clean and len(self._idle) < POOL_MAX:
            self._idle.append((client, time.monotonic()))
            return
        try:
            await client.quit()
        except Exception:
            client.close()

    async def _converse(
        self, client: aiosmtplib.SMTP, message: EmailMessage, to: list[str], *, reused: bool
    ) -> ProviderOutcome | None:
        """One message on ``client``; None when a ``reused`` session turned out to be
        gone in phase 1 (nothing of the message was transmitted)."""
        # Phase 1: nothing of the message has been transmitted.
        try:
            if not reused:
                await client.connect()
            await client.mail(self._settings.sender)
        except aiosmtplib.SMTPAuthenticationError:
            return ProviderOutcome.terminal("smtp_auth_failed")
        except aiosmtplib.SMTPResponseException as exc:
            if reused and exc.code == 421:
                return None  # the server is closing the kept session
            if 400 <= exc.code < 500:
                return ProviderOutcome.retryable("smtp_sender_4xx")
            return ProviderOutcome.terminal("smtp_sender_5xx")
        except (aiosmtplib.SMTPException, OSError):
            if reused:
                return None
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
        """Close the kept sessions (``QUIT``, bounded by the client timeout)."""
        idle, self._idle = self._idle, []
        for client, _ in idle:
            with contextlib.suppress(Exception):
                await client.quit()
            client.close()
