"""Trusted workload authentication (ARCHITECTURE §3).

The package: :mod:`~services.auth.identity` (trusted values, the current identity),
:mod:`~services.auth.keys` (key pairs, the trusted-keys file, development keys),
:mod:`~services.auth.trust` (what each trusted key may sign: orgs, audiences, roles),
:mod:`~services.auth.credentials` (minting, verification),
:mod:`~services.auth.interceptor` (server side), :mod:`~services.auth.client` (client
side) and :mod:`~services.auth.tls`. Import from ``services.auth``.

A caller authenticates as a *workload* with a signed, expiring credential sent as
gRPC metadata ``authorization: Bearer <credential>``::

    nfw1.<b64url(header json)>.<b64url(claims json)>.<b64url(Ed25519 signature)>

    header  {"alg": "EdDSA", "kid": <issuer key id>}
    claims  {"sub": workload, "aud": ["catalog" | "runtime" | "effect-owner", ...],
             "iat": int, "exp": int, "org_id": str,
             "app_installation_id"?, "runtime_capability_id"?,
             "runtime_work_binding_digest"?, "roles"?: [str]}

The signature covers the ASCII text ``nfw1.<header>.<claims>``; JSON is canonical
(``services.digest.canonical_json``) and base64url has no padding. Scope claims nest:
``runtime_capability_id`` needs ``app_installation_id`` and
``runtime_work_binding_digest`` needs ``runtime_capability_id``.

Server side, :class:`AuthInterceptor` verifies the credential with a
:class:`CredentialVerifier` (its failures are :class:`UnauthenticatedError` with
distinct :class:`AuthFailure` reasons; a credential claiming an org, audience or role
its signing key may not sign is one of them, see :mod:`services.auth.trust`), then
inspects every deserialized request message before the servicer sees it
(:func:`check_request_scope`). The rule is:

* a top-level non-repeated ``string org_id`` that is non-empty must equal the trusted org;
* a set top-level message field ``scope``: each of its non-empty string components
  ``org_id``, ``app_installation_id``, ``runtime_capability_id``,
  ``runtime_work_binding_digest`` must equal the trusted one; a component the
  credential does not carry cannot be confirmed and is therefore rejected too;
* a set top-level message field ``binding`` (a ``RuntimeWorkBinding``): the same rule
  for the components it has (``org_id``, ``app_installation_id``,
  ``runtime_capability_id``).

Any disagreement is ``PERMISSION_DENIED``; a body value is never *used* as scope.
Deeper fields are the servicer's job (it reads :func:`current_identity`). Streaming
requests are checked message by message, so request-streaming servicers must consume
the request iterator argument, not ``context.read()``.

Interceptor order: ``[ErrorMappingInterceptor(), AuthInterceptor(verifier)]`` — the
error interceptor is outermost, so the ``FlowError`` raised here is mapped by the one
mapping in ``services.errors``. Health and reflection are exempt (probes and grpcurl
must work without a credential); mTLS, when configured, still guards them.

Nothing here logs metadata or credentials.
"""

from __future__ import annotations

from .client import (
    CredentialCallCredentials,
    CredentialSource,
    bearer_client_interceptors,
    bearer_metadata,
)
from .credentials import CREDENTIAL_PREFIX, CredentialVerifier, mint_credential
from .identity import (
    AuthFailure,
    TrustedIdentity,
    TrustedOrgContext,
    TrustedRuntimeWorkScope,
    WorkloadClaims,
    current_identity,
    identity_context,
)
from .interceptor import EXEMPT_METHOD_PREFIXES, AuthInterceptor, check_request_scope
from .keys import (
    DEV_OPERATOR_CONSTRAINTS,
    DEV_SIGNING_KEY_FILE,
    TRUSTED_KEYS_FILE,
    DevKeyFiles,
    ensure_dev_keys,
    generate_keypair,
    load_signing_key,
    load_trusted_keys,
    service_key_file,
    service_key_id,
)
from .tls import channel_credentials, server_credentials
from .trust import (
    CANCEL_ROLE,
    DELETE_ROLE,
    HANDOFF_SUBMIT_ROLE,
    OPERATE_ROLE,
    OPERATOR_ROLES,
    ROUTING_ROLE,
    SIGNALS_SUBMIT_ROLE,
    UNCONSTRAINED,
    KeyConstraints,
    TrustedKey,
    parse_trusted_keys,
    trusted_keys_document,
)

__all__ = [
    "CANCEL_ROLE",
    "CREDENTIAL_PREFIX",
    "DELETE_ROLE",
    "DEV_OPERATOR_CONSTRAINTS",
    "DEV_SIGNING_KEY_FILE",
    "EXEMPT_METHOD_PREFIXES",
    "HANDOFF_SUBMIT_ROLE",
    "OPERATE_ROLE",
    "OPERATOR_ROLES",
    "ROUTING_ROLE",
    "SIGNALS_SUBMIT_ROLE",
    "TRUSTED_KEYS_FILE",
    "UNCONSTRAINED",
    "AuthFailure",
    "AuthInterceptor",
    "CredentialCallCredentials",
    "CredentialSource",
    "CredentialVerifier",
    "DevKeyFiles",
    "KeyConstraints",
    "TrustedIdentity",
    "TrustedKey",
    "TrustedOrgContext",
    "TrustedRuntimeWorkScope",
    "WorkloadClaims",
    "bearer_client_interceptors",
    "bearer_metadata",
    "channel_credentials",
    "check_request_scope",
    "current_identity",
    "ensure_dev_keys",
    "generate_keypair",
    "identity_context",
    "load_signing_key",
    "load_trusted_keys",
    "mint_credential",
    "parse_trusted_keys",
    "server_credentials",
    "service_key_file",
    "service_key_id",
    "trusted_keys_document",
]
