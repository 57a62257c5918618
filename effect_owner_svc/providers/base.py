"""The provider plug-in interface of the effect owner (STYLE 16; spec §15.2, §15.3).

A provider performs one kind of remote effect. The owner's command dispatcher calls it
only after the command's acceptance committed, outside any transaction, with the
command's *provider idempotency key* — the same key on every attempt of the command
(``services.effect_contract.provider_idempotency_key``)::

    class Provider(Protocol):
        name: str               # provider type, "email" | "webhook"
        replay_safe: bool       # the remote side deduplicates on the idempotency key
        async def submit(command: ProviderCommand) -> ProviderOutcome
        async def lookup(idempotency_key: str) -> ProviderOutcome | None   # None: no lookup
        async def aclose() -> None

``submit`` never raises for remote failures: it classifies them into a
:class:`ProviderOutcome` — ``SUCCEEDED``; ``FAILED_RETRYABLE`` (proven not applied, e.g.
the connection was refused before anything was sent, or the server answered 5xx/4xx
"try again"); ``FAILED_TERMINAL`` (the server refused for good); ``OUTCOME_UNKNOWN`` (the
request may have been applied: a timeout or a lost connection after the request was
sent). ``OUTCOME_UNKNOWN`` is never retried blindly: the dispatcher reconciles it
through ``lookup`` where the provider has one, replays it with the same idempotency key
only when ``replay_safe`` (the remote side collapses the duplicate), and otherwise
quarantines the command.

Providers are built from owner configuration by one factory
(:func:`effect_owner_svc.providers.factory.build_providers`); nothing in a Flow's metadata
or payload can choose an endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from services.digest import versioned_digest

__all__ = [
    "Provider",
    "ProviderCommand",
    "ProviderOutcome",
    "ProviderOutcomeKind",
]


class ProviderOutcomeKind(StrEnum):
    """Classification of one provider call (``NOT_FOUND`` only from ``lookup``)."""

    SUCCEEDED = "SUCCEEDED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_TERMINAL = "FAILED_TERMINAL"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    NOT_FOUND = "NOT_FOUND"


@dataclass(frozen=True)
class ProviderOutcome:
    """What a provider call proved.

    Attributes:
        kind: the classification.
        safe_error_code: non-sensitive diagnostic code (never a server message).
        result: safe result evidence (e.g. the Message-ID), digested into the receipt.
    """

    kind: ProviderOutcomeKind
    safe_error_code: str = ""
    result: Mapping[str, Any] = field(default_factory=dict)

    @property
    def result_digest(self) -> str:
        """Digest of :attr:`result` (``""`` when there is none)."""
        return versioned_digest("effect-result", self.result) if self.result else ""

    @classmethod
    def succeeded(cls, **result: Any) -> ProviderOutcome:
        return cls(ProviderOutcomeKind.SUCCEEDED, "", result)

    @classmethod
    def retryable(cls, code: str) -> ProviderOutcome:
        return cls(ProviderOutcomeKind.FAILED_RETRYABLE, code)

    @classmethod
    def terminal(cls, code: str) -> ProviderOutcome:
        return cls(ProviderOutcomeKind.FAILED_TERMINAL, code)

    @classmethod
    def unknown(cls, code: str) -> ProviderOutcome:
        return cls(ProviderOutcomeKind.OUTCOME_UNKNOWN, code)


@dataclass(frozen=True)
class ProviderCommand:
    """What a provider needs of an accepted command (a frozen copy; no credentials)."""

    org_id: str
    command_id: str
    effect_owner_kind: str
    idempotency_key: str
    payload_schema_version: int
    payload: Mapping[str, Any]


class Provider(Protocol):
    """An effect-owner provider plug-in (see the module docstring)."""

    name: str
    replay_safe: bool

    async def submit(self, command: ProviderCommand) -> ProviderOutcome:
        """Perform the remote effect once; classify, never raise for remote failures."""
        ...

    async def lookup(self, idempotency_key: str) -> ProviderOutcome | None:
        """What the remote side knows about the key; None when there is no lookup."""
        ...

    async def aclose(self) -> None:
        """Release connections (idempotent)."""
        ...
