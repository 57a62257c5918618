"""Operator controls of a Flow run (issue 14 item 5): ``PauseRun``, ``ResumeRun``,
``RetryQuarantinedRun``, ``RestartFromCheckpoint`` behind ``FlowRunService``.

Built exactly like ``CancelRun`` (:mod:`runtime_svc.runs.service`): the role
(:data:`~services.auth.trust.OPERATE_ROLE`) is checked before any read; the trusted org
comes from the credential; the store decision, its audit record (the caller's subject and
signing key id, never the credential), the answer's view read and the request-ledger row
(``request_id`` dedupe) commit in **one** transaction; a caller's
``expected_state_version`` is compared inside the store's compare-and-swap. Semantics of
the decisions: :mod:`runtime_svc.kernel.transitions_operator` (pause/resume, restart
from a checkpoint) and :mod:`runtime_svc.kernel.reconcile` (the quarantine retry, the same
store path as ``python -m runtime_svc.ops quarantine retry``).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.reconcile import Resolution
from runtime_svc.kernel.store_operator import (
    OperatorActor,
    pause_run_txn,
    restart_run_txn,
    resume_run_txn,
)
from runtime_svc.kernel.store_reads import get_run_txn
from runtime_svc.kernel.store_reconcile import reconcile_quarantine_txn
from runtime_svc.runs.service import RunService, RunView, _require_role
from services.auth import OPERATE_ROLE, TrustedIdentity
from services.errors import InvalidArgumentError
from services.request_dedupe import RequestKey

__all__ = ["MAX_REASON", "OPERATE_ROLE", "RunOperator"]

#: Longest operator reason kept in the audit record.
MAX_REASON = 200

Encode = Callable[[RunView], bytes]


def _actor(identity: TrustedIdentity) -> OperatorActor:
    return OperatorActor(identity.subject or identity.key_id, identity.key_id)


def _reason(reason: str, *, required: bool) -> str:
    if len(reason) > MAX_REASON or (required and not reason.strip()):
        need = "1" if required else "0"
        raise InvalidArgumentError(
            f"reason must be {need}-{MAX_REASON} characters", field_path="reason"
        )
    return reason


class RunOperator:
    """The operator controls over one :class:`~runtime_svc.runs.service.RunService`."""

    def __init__(self, runs: RunService) -> None:
        self._runs = runs

    async def _view(self, conn: AsyncConnection, org: str, flow_run_id: str) -> RunView:
        return await self._runs.view_txn(conn, await get_run_txn(conn, org, flow_run_id))

    async def _pause_txn(
        self,
        conn: AsyncConnection,
        identity: TrustedIdentity,
        flow_run_id: str,
        expected: int | None,
        reason: str,
        *,
        pause: bool,
    ) -> RunView:
        org = identity.org_id
        fn = pause_run_txn if pause else resume_run_txn
        await fn(
            conn, org, flow_run_id, _actor(identity), expected_state_version=expected, reason=reason
        )
        return await self._view(conn, org, flow_run_id)

    async def _retry_txn(
        self,
        conn: AsyncConnection,
        identity: TrustedIdentity,
        flow_run_id: str,
        expected: int | None,
        reason: str,
    ) -> RunView:
        await reconcile_quarantine_txn(
            conn,
            identity.org_id,
            flow_run_id,
            Resolution.RETRY,
            actor=_actor(identity),
            reason=reason,
            max_attempts=self._runs.store.policy.max_attempts,
            expected_state_version=expected,
            request_rpc="RetryQuarantinedRun",
        )
        return await self._view(conn, identity.org_id, flow_run_id)

    async def pause_run_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        key: RequestKey,
        encode: Encode,
        *,
        expected_state_version: int | None = None,
        reason: str = "",
    ) -> bytes:
        """Pause an active run; idempotent. Deduplicated on ``key`` (the role is checked
        first, before any read).

        Raises:
            PermissionDeniedError: the credential lacks ``flow.runs.operate``.
            NotFoundError: missing, foreign or deleted.
            FailedPreconditionError: ``run_terminal``, ``run_cancelling``,
                ``legacy_owned_run``; ``state_version_mismatch``.
            InvalidArgumentError: reason over 200 characters.
        """
        _require_role(identity, OPERATE_ROLE, "pause")
        why = _reason(reason, required=False)
        return await self._runs.run_once(
            key,
            lambda conn: self._pause_txn(
                conn, identity, flow_run_id, expected_state_version, why, pause=True
            ),
            encode,
        )

    async def resume_run_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        key: RequestKey,
        encode: Encode,
        *,
        expected_state_version: int | None = None,
        reason: str = "",
    ) -> bytes:
        """Clear a pause; idempotent (a run that is not paused answers unchanged).
        Deduplicated on ``key`` (the role is checked first).

        Raises:
            PermissionDeniedError: the credential lacks ``flow.runs.operate``.
            NotFoundError: missing, foreign or deleted.
            FailedPreconditionError: ``legacy_owned_run``; ``state_version_mismatch``.
        """
        _require_role(identity, OPERATE_ROLE, "resume")
        why = _reason(reason, required=False)
        return await self._runs.run_once(
            key,
            lambda conn: self._pause_txn(
                conn, identity, flow_run_id, expected_state_version, why, pause=False
            ),
            encode,
        )

    async def retry_quarantined_run_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        reason: str,
        key: RequestKey,
        encode: Encode,
        *,
        expected_state_version: int | None = None,
    ) -> bytes:
        """The operator's recorded decision to retry a reconciled commit-unknown
        quarantine (:func:`~runtime_svc.kernel.store_reconcile.reconcile_quarantine_txn`),
        deduplicated on ``key`` (the role is checked first).

        Raises:
            PermissionDeniedError: the credential lacks ``flow.runs.operate``.
            InvalidArgumentError: empty or over-long ``reason``.
            NotFoundError: missing, foreign or deleted.
            FailedPreconditionError: the refusal code (``not_quarantined``,
                ``not_commit_unknown``, ``marker_shows_commit``, ``attempt_budget_spent``,
                ``effect_outcome_unknown``) or ``state_version_mismatch``.
        """
        _require_role(identity, OPERATE_ROLE, "retry")
        why = _reason(reason, required=True)
        return await self._runs.run_once(
            key,
            lambda conn: self._retry_txn(conn, identity, flow_run_id, expected_state_version, why),
            encode,
        )

    async def _restart_txn(
        self,
        conn: AsyncConnection,
        identity: TrustedIdentity,
        flow_run_id: str,
        checkpoint_id: str,
        expected: int | None,
        reason: str,
    ) -> RunView:
        await restart_run_txn(
            conn,
            identity.org_id,
            flow_run_id,
            checkpoint_id,
            _actor(identity),
            reason=reason,
            expected_state_version=expected,
        )
        return await self._view(conn, identity.org_id, flow_run_id)

    def _restart_args(self, identity: TrustedIdentity, checkpoint_id: str, reason: str) -> str:
        _require_role(identity, OPERATE_ROLE, "restart")
        if not checkpoint_id:
            raise InvalidArgumentError("checkpoint_id is required", field_path="checkpoint_id")
        return _reason(reason, required=True)

    async def restart_from_checkpoint_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        checkpoint_id: str,
        reason: str,
        key: RequestKey,
        encode: Encode,
        *,
        expected_state_version: int | None = None,
    ) -> bytes:
        """Restart a failed run from one of its own checkpoints
        (:func:`~runtime_svc.kernel.store_operator.restart_run_txn`), deduplicated on
        ``key`` (the role is checked first).

        Raises:
            PermissionDeniedError: the credential lacks ``flow.runs.operate``.
            InvalidArgumentError: no checkpoint id; empty or over-long ``reason``.
            NotFoundError: run or checkpoint missing, foreign or of another run.
            FailedPreconditionError: ``run_quarantined``, ``run_not_failed``,
                ``checkpoint_not_a_step_input``, ``effect_outcome_unknown``,
                ``legacy_owned_run`` or ``state_version_mismatch``.
        """
        why = self._restart_args(identity, checkpoint_id, reason)
        return await self._runs.run_once(
            key,
            lambda conn: self._restart_txn(
                conn, identity, flow_run_id, checkpoint_id, expected_state_version, why
            ),
            encode,
        )
