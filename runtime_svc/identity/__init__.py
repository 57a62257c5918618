"""Identity and reauthorization of Flow runs (§17).

* :mod:`.rules` — pure: authorization-context digests, the reauthorization decision.
* :mod:`.directory` — the persisted principal directory (``flow_principals``) and the
  run identity columns of ``flow_runs`` (revision ``0012_identity``).
* :mod:`.reauth` — the step worker's per-step reauthorization (imports the executor, so
  it is not re-exported here; import it from its module).
"""

from __future__ import annotations

from .directory import (
    MAX_PRINCIPAL_ID,
    PrincipalDirectory,
    current_principal_id,
    principal_states_txn,
    read_run_identity_txn,
    record_initiator_txn,
    record_run_identity_txn,
    run_identities_txn,
)
from .rules import (
    Allowed,
    DenialOutcome,
    Denied,
    Handoff,
    PrincipalState,
    PrincipalStatus,
    ReasonCode,
    RunIdentity,
    Verdict,
    authorization_context_digest,
    decide,
    permission_digest,
    reauthorizes,
    run_principal_mode,
)

__all__ = [
    "MAX_PRINCIPAL_ID",
    "Allowed",
    "DenialOutcome",
    "Denied",
    "Handoff",
    "PrincipalDirectory",
    "PrincipalState",
    "PrincipalStatus",
    "ReasonCode",
    "RunIdentity",
    "Verdict",
    "authorization_context_digest",
    "current_principal_id",
    "decide",
    "permission_digest",
    "principal_states_txn",
    "read_run_identity_txn",
    "reauthorizes",
    "record_initiator_txn",
    "record_run_identity_txn",
    "run_identities_txn",
    "run_principal_mode",
]
