"""What each trusted key may sign: the constraints of the trusted-keys file.

A server trusts a set of issuer keys (``FLOW_AUTH_TRUSTED_KEYS``). Each entry states the
orgs (or ``*``, for a service key that acts for every org), the audiences and the roles
its credentials may claim; a credential whose claims exceed its key's constraints is
refused ``UNAUTHENTICATED`` (``credential_exceeds_key_constraints``), however valid its
signature. The file (version 2)::

    {"version": 2,
     "keys": {
       "ops-acme":        {"public_key": "-----BEGIN PUBLIC KEY-----...",
                           "orgs": ["org-acme"], "audiences": ["runtime"],
                           "roles": ["flow.runs.cancel", "flow.runs.delete"]},
       "runtime-service": {"public_key": "...", "orgs": ["*"],
                           "audiences": ["catalog", "effect-owner"], "roles": []}}}

``roles: ["*"]`` allows any role (use it only for keys that are meant to be
unconstrained). The earlier format ``{key_id: PEM}`` has no constraints: it is read as
*unconstrained* (``*`` everywhere) outside production, with a warning, and refused with
``FLOW_ENV=production``; ``ensure_dev_keys`` migrates the development file written by an
earlier ``make run`` to version 2.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from services.config import ConfigError, ServiceName

__all__ = [
    "ANY",
    "CANCEL_ROLE",
    "DELETE_ROLE",
    "HANDOFF_SUBMIT_ROLE",
    "OPERATE_ROLE",
    "OPERATOR_ROLES",
    "ROUTING_ROLE",
    "SIGNALS_SUBMIT_ROLE",
    "TRUSTED_KEYS_VERSION",
    "UNCONSTRAINED",
    "KeyConstraints",
    "TrustedKey",
    "parse_trusted_keys",
    "trusted_keys_document",
]

_log = logging.getLogger(__name__)

#: Wildcard of ``orgs`` and ``roles``.
ANY = "*"
#: May cancel a Flow run (``FlowRunService.CancelRun``).
CANCEL_ROLE = "flow.runs.cancel"
#: May delete a Flow run (``FlowRunService.DeleteRun``).
DELETE_ROLE = "flow.runs.delete"
#: May take the operator controls of a Flow run (``FlowRunService.PauseRun``,
#: ``ResumeRun``, ``RetryQuarantinedRun``, ``RestartFromCheckpoint``): one role for
#: every decision that overrides the scheduler, audited with the caller's identity.
OPERATE_ROLE = "flow.runs.operate"
#: May submit a durable wake signal (``WakeSignalService.SubmitWakeSignal``).
SIGNALS_SUBMIT_ROLE = "flow.signals.submit"
#: May hand an effect to an effect owner (``AcceptHandoff``/``RejectIfUnaccepted``): the
#: runtime's own service credential only.
HANDOFF_SUBMIT_ROLE = "effects.handoff.submit"
#: May act as a deployment routing statement (§20.2 trusted OrgID backfill,
#: ``flowctl deploy routing mint``; checked by ``runtime_svc.migration.authority``).
ROUTING_ROLE = "flow.deployment.routing"
#: Every role a service checks today; what an operator key of the dev stack may sign.
OPERATOR_ROLES: tuple[str, ...] = (
    CANCEL_ROLE,
    DELETE_ROLE,
    OPERATE_ROLE,
    SIGNALS_SUBMIT_ROLE,
    ROUTING_ROLE,
)
TRUSTED_KEYS_VERSION = 2
_ENTRY_KEYS = frozenset({"public_key", "orgs", "audiences", "roles"})
_AUDIENCES = frozenset(s.value for s in ServiceName)


@dataclass(frozen=True)
class KeyConstraints:
    """The orgs, audiences and roles a key's credentials may claim (``*`` = any)."""

    orgs: frozenset[str]
    audiences: frozenset[str]
    roles: frozenset[str]

    def exceeded_by(self, org_id: str, audiences: Iterable[str], roles: Iterable[str]) -> str:
        """The first claim outside the constraints (``org_id``, ``aud``, ``roles``), or ``""``."""
        if ANY not in self.orgs and org_id not in self.orgs:
            return "org_id"
        if not set(audiences) <= self.audiences:
            return "aud"
        if ANY not in self.roles and not set(roles) <= self.roles:
            return "roles"
        return ""

    def to_json(self) -> dict[str, list[str]]:
        return {
            "orgs": sorted(self.orgs),
            "audiences": sorted(self.audiences),
            "roles": sorted(self.roles),
        }


#: What the deprecated ``{key_id: PEM}`` form means: anything.
UNCONSTRAINED = KeyConstraints(frozenset({ANY}), _AUDIENCES, frozenset({ANY}))


@dataclass(frozen=True)
class TrustedKey:
    """A trusted issuer key and what it may sign."""

    public_key: Ed25519PublicKey
    constraints: KeyConstraints = UNCONSTRAINED


def _public_key(kid: str, pem: object, where: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(str(pem).encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ConfigError(f"trusted key {kid!r} in {where} is not a PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"trusted key {kid!r} in {where} is not an Ed25519 key")
    return key


def _names(
    entry: Mapping[str, Any], name: str, kid: str, where: str, *, empty: bool
) -> frozenset[str]:
    value = entry.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"trusted key {kid!r} in {where}: {name} must be a list of strings")
    if not value and not empty:
        raise ConfigError(f"trusted key {kid!r} in {where}: {name} must not be empty")
    return frozenset(value)


def _entry(kid: str, entry: object, where: str) -> TrustedKey:
    if not isinstance(entry, dict):
        raise ConfigError(f"trusted key {kid!r} in {where} must be an object")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    missing = sorted(_ENTRY_KEYS - set(entry))
    if unknown or missing:
        raise ConfigError(
            f"trusted key {kid!r} in {where}: needs exactly {sorted(_ENTRY_KEYS)} "
            f"(unknown {unknown}, missing {missing})"
        )
    audiences = _names(entry, "audiences", kid, where, empty=False)
    if not audiences <= _AUDIENCES:
        raise ConfigError(
            f"trusted key {kid!r} in {where}: audiences must be among {sorted(_AUDIENCES)}"
        )
    constraints = KeyConstraints(
        orgs=_names(entry, "orgs", kid, where, empty=False),
        audiences=audiences,
        roles=_names(entry, "roles", kid, where, empty=True),
    )
    return TrustedKey(_public_key(kid, entry["public_key"], where), constraints)


def parse_trusted_keys(
    raw: object, where: str, *, allow_unconstrained: bool
) -> dict[str, TrustedKey]:
    """The keys of a trusted-keys document (either format, see module docstring).

    Args:
        raw: the parsed JSON.
        where: the file name, for messages.
        allow_unconstrained: read the deprecated ``{key_id: PEM}`` form (not in production).

    Raises:
        ConfigError: malformed, empty, a non-Ed25519 key, or the deprecated form when it
            is not allowed.
    """
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"trusted keys {where} must be a non-empty JSON object")
    if "keys" in raw or "version" in raw:
        if raw.get("version") != TRUSTED_KEYS_VERSION or set(raw) != {"version", "keys"}:
            raise ConfigError(
                f"trusted keys {where} must be {{'version': {TRUSTED_KEYS_VERSION}, 'keys': …}}"
            )
        keys = raw["keys"]
        if not isinstance(keys, dict) or not keys:
            raise ConfigError(f"trusted keys {where}: 'keys' must be a non-empty object")
        return {str(kid): _entry(str(kid), entry, where) for kid, entry in keys.items()}
    if not allow_unconstrained:
        raise ConfigError(
            f"trusted keys {where} use the deprecated unconstrained form {{key_id: PEM}}; "
            f"production needs version {TRUSTED_KEYS_VERSION} with orgs, audiences and roles "
            "for every key (README, Authentication)"
        )
    _log.warning(
        "trusted keys %s use the deprecated unconstrained form {key_id: PEM}: every key may "
        "sign any org, audience and role; migrate to version %d",
        where,
        TRUSTED_KEYS_VERSION,
    )
    return {str(kid): TrustedKey(_public_key(str(kid), pem, where)) for kid, pem in raw.items()}


def trusted_keys_document(entries: Mapping[str, tuple[str, KeyConstraints]]) -> dict[str, Any]:
    """The version-2 document of ``{key_id: (public-key PEM, constraints)}``."""
    return {
        "version": TRUSTED_KEYS_VERSION,
        "keys": {
            kid: {"public_key": pem, **constraints.to_json()}
            for kid, (pem, constraints) in sorted(entries.items())
        },
    }
