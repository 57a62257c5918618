"""The webhook provider: an HTTP(S) ``POST`` through ``httpx``.

The endpoint is owner configuration (``FLOW_EFFECT_WEBHOOK_URL``), never Flow metadata;
the body is the frozen payload as canonical JSON; every attempt of a command carries the
same ``Idempotency-Key`` header (the command's provider idempotency key). Redirects are
never followed.

Classification:

* ``2xx`` → ``SUCCEEDED``;
* ``408``, ``425``, ``429`` and ``5xx`` → ``FAILED_RETRYABLE`` (the receiver answered that
  it did not apply the request; a receiver honouring the key collapses any duplicate);
* other ``4xx`` → ``FAILED_TERMINAL``;
* connection refused / connect or pool timeout → ``FAILED_RETRYABLE`` (nothing was sent);
* a read/write timeout or a connection dropped after the request was sent, or any
  ``1xx``/``3xx`` answer → ``OUTCOME_UNKNOWN``.

``replay_safe`` is ``FLOW_EFFECT_WEBHOOK_IDEMPOTENT``: when the receiver honours
``Idempotency-Key`` an unknown outcome is reconciled by sending the same key again.
``lookup`` exists when ``FLOW_EFFECT_WEBHOOK_STATUS_URL`` is set: ``GET`` with the key in
``Idempotency-Key``; ``200 {"outcome": "succeeded"|"failed"}`` is definite, ``404`` is
``NOT_FOUND`` (never proof of absence), anything else is a failed lookup.
"""

from __future__ import annotations

import json

import httpx

from effect_owner_svc.providers.base import ProviderCommand, ProviderOutcome, ProviderOutcomeKind
from services.config import WebhookSettings
from services.digest import canonical_json

__all__ = ["WebhookProvider", "classify_status"]

_RETRYABLE_4XX = frozenset({408, 425, 429})


def classify_status(status: int) -> ProviderOutcome:
    """Classify an HTTP status code of the POST."""
    if 200 <= status < 300:
        return ProviderOutcome.succeeded(http_status=status)
    if status in _RETRYABLE_4XX or 500 <= status < 600:
        return ProviderOutcome.retryable(f"http_{status}")
    if 400 <= status < 500:
        return ProviderOutcome.terminal(f"http_{status}")
    return ProviderOutcome.unknown(f"http_{status}")


class WebhookProvider:
    """POSTs commands to one configured endpoint (see the module docstring)."""

    name = "webhook"

    def __init__(
        self, settings: WebhookSettings, *, client: httpx.AsyncClient | None = None
    ) -> None:
        if not settings.url:
            raise ValueError("the webhook provider needs FLOW_EFFECT_WEBHOOK_URL")
        self._settings = settings
        self.replay_safe = settings.idempotent_receiver
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout_s),
            follow_redirects=False,
            headers={"User-Agent": "nexus-flow-effect-owner"},
        )

    async def submit(self, command: ProviderCommand) -> ProviderOutcome:
        body = canonical_json(dict(command.payload))
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": command.idempotency_key,
            "X-Nexus-Flow-Command": command.command_id,
        }
        try:
            response = await self._client.post(self._settings.url, content=body, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
            return ProviderOutcome.retryable("http_unavailable")
        except httpx.TimeoutException:
            return ProviderOutcome.unknown("http_timeout_after_send")
        except httpx.TransportError:
            return ProviderOutcome.unknown("http_connection_lost")
        return classify_status(response.status_code)

    async def lookup(self, idempotency_key: str) -> ProviderOutcome | None:
        if not self._settings.status_url:
            return None
        try:
            response = await self._client.get(
                self._settings.status_url, headers={"Idempotency-Key": idempotency_key}
            )
        except httpx.HTTPError:
            return ProviderOutcome.unknown("lookup_unavailable")
        if response.status_code == 404:
            return ProviderOutcome(ProviderOutcomeKind.NOT_FOUND, "lookup_not_found")
        if response.status_code != 200:
            return ProviderOutcome.unknown(f"lookup_http_{response.status_code}")
        try:
            outcome = json.loads(response.content).get("outcome")
        except (ValueError, AttributeError):
            return ProviderOutcome.unknown("lookup_malformed")
        if outcome == "succeeded":
            return ProviderOutcome.succeeded(http_status=200, reconciled=True)
        if outcome == "failed":
            return ProviderOutcome.terminal("remote_failed")
        return ProviderOutcome.unknown("lookup_malformed")

    async def aclose(self) -> None:
        await self._client.aclose()
