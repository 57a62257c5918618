"""Build the owner's providers from configuration — the one factory (STYLE 16).

``FLOW_EFFECT_PROVIDERS`` maps the effect owner kinds this owner serves to a provider
type (``email`` or ``webhook``). A webhook kind without ``FLOW_EFFECT_WEBHOOK_URL`` is
not served (``AcceptHandoff`` refuses it, nothing is accepted). The SMTP password is read
from ``FLOW_EFFECT_SMTP_PASSWORD_FILE`` here, once, and never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from effect_owner_svc.providers.base import Provider
from effect_owner_svc.providers.email import EmailProvider
from effect_owner_svc.providers.webhook import WebhookProvider
from services.config import ConfigError, EffectOwnerSettings

__all__ = ["ProviderSet", "build_providers", "served_kinds"]

log = logging.getLogger(__name__)


class ProviderSet(Mapping[str, Provider]):
    """Providers by effect owner kind; closes each distinct provider once."""

    def __init__(self, by_kind: Mapping[str, Provider]) -> None:
        self._by_kind = dict(by_kind)

    def __getitem__(self, kind: str) -> Provider:
        return self._by_kind[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_kind)

    def __len__(self) -> int:
        return len(self._by_kind)

    async def aclose(self) -> None:
        seen: set[int] = set()
        for provider in self._by_kind.values():
            if id(provider) not in seen:
                seen.add(id(provider))
                await provider.aclose()


def served_kinds(settings: EffectOwnerSettings) -> frozenset[str]:
    """The effect owner kinds this configuration serves (no provider is built)."""
    return frozenset(
        kind
        for kind, ptype in settings.providers.items()
        if ptype == "email" or (ptype == "webhook" and settings.webhook.url)
    )


def build_providers(settings: EffectOwnerSettings) -> ProviderSet:
    """The providers of every served owner kind.

    Raises:
        ConfigError: the SMTP password file cannot be read.
    """
    password: str | None = None
    if settings.smtp.password_file is not None:
        try:
            password = settings.smtp.password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read FLOW_EFFECT_SMTP_PASSWORD_FILE: {type(exc).__name__}"
            ) from None
    email: EmailProvider | None = None
    webhook: WebhookProvider | None = None
    by_kind: dict[str, Provider] = {}
    for kind, ptype in settings.providers.items():
        if ptype == "email":
            email = email or EmailProvider(settings.smtp, password=password)
            by_kind[kind] = email
        elif ptype == "webhook":
            if not settings.webhook.url:
                log.warning("effect owner kind %s not served: FLOW_EFFECT_WEBHOOK_URL unset", kind)
                continue
            webhook = webhook or WebhookProvider(settings.webhook)
            by_kind[kind] = webhook
    return ProviderSet(by_kind)
