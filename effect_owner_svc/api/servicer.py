"""``nexus.flow.effect.v1.EffectOwnerService``: the gRPC face of the owner inbox,
commands and receipts (spec §10.7, §15).

Thin methods (decode → store → encode). The work scope always comes from the verified
credential; the auth interceptor has already refused a body ``scope`` that differs from
it, and :func:`~effect_owner_svc.api.proto.handoff_from_request` refuses an envelope that
does. ``AcceptHandoff`` and ``RejectIfUnaccepted`` need the role
``effects.handoff.submit`` (the runtime's own workload credential); reads need only the
complete work scope, and a command of another scope answers ``NOT_FOUND`` exactly like a
missing one (a read that finds nothing never proves non-acceptance).

Mutating RPCs are deduplicated on ``(trusted scope, RPC, request_id)`` by the shared
``services.request_dedupe`` ledger (``owner_requests``): a retry gets the original
response bytes. The durable dedupe of the inbox itself is the handoff key.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.api.proto import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    attributes_from_reject,
    command_proto,
    decode_page_token,
    encode_page_token,
    fence_proto,
    handoff_from_request,
    receipt_proto,
    states_from_request,
)
from effect_owner_svc.commands.records import CommandRecord
from effect_owner_svc.commands.store import attempts_txn, get_command_txn, list_commands_txn
from effect_owner_svc.errors import OwnerKindNotServedError
from effect_owner_svc.inbox.fence import HandoffAttributes, key_scope_mismatch
from effect_owner_svc.inbox.store import (
    Accepted,
    Refusal,
    accept_handoff_txn,
    get_fence_txn,
    refuse_foreign_key,
    reject_if_unaccepted_txn,
)
from effect_owner_svc.observability import accept_span, handoff_decided
from effect_owner_svc.receipts.store import get_receipt_txn
from effect_owner_svc.schema import owner_requests
from services.auth import TrustedIdentity, TrustedRuntimeWorkScope, current_identity
from services.db import transaction
from services.effect_contract import HANDOFF_SUBMIT_ROLE
from services.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from services.faults import CrashPoint, crash_point
from services.grpc_server import ServiceRegistration
from services.proto import effect_v1
from services.request_dedupe import DedupeScope, JoinedRecord, RequestKey, RequestLedger

if TYPE_CHECKING:
    from effect_owner_svc.dispatcher.commands import CommandSeats

__all__ = ["SERVICE_NAME", "EffectOwnerServicer", "build_effect_owner_service"]

SERVICE_NAME = "nexus.flow.effect.v1.EffectOwnerService"

Context = Any  # grpc.aio.ServicerContext


def _handoff_caller(identity: TrustedIdentity) -> TrustedRuntimeWorkScope:
    if HANDOFF_SUBMIT_ROLE not in identity.roles:
        raise PermissionDeniedError(
            f"the workload credential may not hand off effects (role {HANDOFF_SUBMIT_ROLE} "
            "missing)",
            reason="role_missing",
        )
    return identity.require_work_scope()


def _request_scope(request: Any) -> TrustedRuntimeWorkScope:
    if not request.HasField("scope"):
        raise InvalidArgumentError("scope is required", field_path="scope")
    return current_identity().require_work_scope()


class EffectOwnerServicer(effect_v1.EffectOwnerServiceServicer):
    """Accept/reject fence, command and receipt reads of one owner database.

    Args:
        engine: the owner database.
        served_kinds: effect owner kinds this owner has providers for.
        on_accepted: called after a new command committed ``ACCEPTED`` (wakes this
            process's dispatcher, which claims it).
        seats: this process's command dispatcher, when acceptances pre-claim (ADR 0008):
            a new command is then inserted leased to it with its first attempt and
            handed over after the commit.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        served_kinds: Collection[str],
        *,
        on_accepted: Callable[[CommandRecord], None] | None = None,
        seats: CommandSeats | None = None,
    ) -> None:
        self._engine = engine
        self._kinds = frozenset(served_kinds)
        self._seats = seats
        self._on_accepted = on_accepted
        self._ledger = RequestLedger(owner_requests)

    async def AcceptHandoff(self, request: Any, context: Context) -> Any:
        identity = current_identity()
        trusted = _handoff_caller(identity)
        key = RequestKey.of(DedupeScope.of_identity(identity), "AcceptHandoff", request)
        if not request.HasField("scope"):
            raise InvalidArgumentError("scope is required", field_path="scope")
        handoff = handoff_from_request(request, trusted)
        if handoff.effect_owner_kind not in self._kinds:
            raise OwnerKindNotServedError(handoff.effect_owner_kind)
        if key_scope_mismatch(handoff.attributes):
            await refuse_foreign_key(self._engine, handoff.attributes)

        seat = None if self._seats is None else self._seats.reserve(handoff.effect_owner_kind)
        lease = None if seat is None else seat.lease

        async def work(
            conn: AsyncConnection, _now: datetime, joined: JoinedRecord[Accepted | Refusal] | None
        ) -> Accepted | Refusal:
            # The ledger lookup read the clock (one statement) and kept it as this
            # transaction's db_now, which the acceptance's clock read then answers from;
            # a new acceptance's ledger row rides last in its round trip.
            return await accept_handoff_txn(
                conn, handoff, preclaim=lease, record=None if joined is None else joined.write
            )

        def encode(value: Accepted | Refusal) -> bytes | None:
            if isinstance(value, Refusal):
                return None  # refusals are not recorded: a retry decides again
            return bytes(_accept_response(value).SerializeToString())

        try:
            # The command keeps this span's trace context: its provider call and receipt
            # continue the run's trace (the envelope's context when the call carried none).
            with accept_span(
                request.envelope.trace_context, handoff.attributes.runtime_outbox_message_id
            ):
                done = await self._ledger.execute_joined_at(self._engine, key, work, encode)
            handoff_decided(done.value)
            if done.replayed or done.value is None:
                return done.message(effect_v1.AcceptHandoffResponse)
            if isinstance(done.value, Refusal):
                raise done.value.error()
            if not done.value.duplicate:
                crash_point(CrashPoint.AFTER_INBOX_ACCEPT, handoff.effect_owner_kind)
                if seat is not None and done.value.started is not None:
                    # Committed leased, its attempt in flight: the provider call starts now.
                    seat.hand(done.value.started)
                elif self._on_accepted is not None:
                    # A new command: wake this process's dispatcher, which claims it.
                    self._on_accepted(done.value.command)
            return done.message(effect_v1.AcceptHandoffResponse)
        finally:
            if seat is not None:
                seat.release()  # no-op after the hand-over

    async def RejectIfUnaccepted(self, request: Any, context: Context) -> Any:
        identity = current_identity()
        trusted = _handoff_caller(identity)
        key = RequestKey.of(DedupeScope.of_identity(identity), "RejectIfUnaccepted", request)
        attrs = attributes_from_reject(request, trusted)
        if key_scope_mismatch(attrs):
            await refuse_foreign_key(self._engine, attrs)

        async def work(conn: AsyncConnection) -> Any:
            return await reject_if_unaccepted_txn(conn, attrs)

        def encode(value: Any) -> bytes | None:
            if isinstance(value, Refusal):
                return None
            return bytes(
                effect_v1.RejectIfUnacceptedResponse(fence=fence_proto(value)).SerializeToString()
            )

        done = await self._ledger.execute(self._engine, key, work, encode)
        if isinstance(done.value, Refusal):
            raise done.value.error()
        return done.message(effect_v1.RejectIfUnacceptedResponse)

    async def GetCommand(self, request: Any, context: Context) -> Any:
        scope = _request_scope(request)
        lookup = request.WhichOneof("lookup")
        if lookup is None or not getattr(request, lookup):
            raise InvalidArgumentError(
                "command_id or effect_handoff_key is required", field_path="lookup"
            )
        value = getattr(request, lookup)
        async with transaction(self._engine, readonly=True) as conn:
            command = await get_command_txn(conn, scope, **{lookup: value})
            if command is None:
                raise NotFoundError("ExternalCommand", value)
            attempts = await attempts_txn(conn, scope.org_id, command.command_id)
            fence = await get_fence_txn(
                conn,
                HandoffAttributes(
                    org_id=scope.org_id,
                    app_installation_id=scope.app_installation_id,
                    runtime_capability_id=scope.runtime_capability_id,
                    runtime_work_binding_digest=scope.runtime_work_binding_digest,
                    effect_handoff_key=command.effect_handoff_key,
                    runtime_outbox_message_id="",
                    payload_digest="",
                ),
            )
        response = effect_v1.GetCommandResponse(command=command_proto(command, attempts))
        if fence is not None:
            response.fence.CopyFrom(fence_proto(fence))
        return response

    async def ListCommands(self, request: Any, context: Context) -> Any:
        scope = _request_scope(request)
        if request.page_size < 0:
            raise InvalidArgumentError("page_size must be >= 0", field_path="page_size")
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        states = states_from_request(list(request.states))
        after = decode_page_token(request.page_token)
        async with transaction(self._engine, readonly=True) as conn:
            commands = await list_commands_txn(
                conn,
                scope,
                states=states,
                flow_run_id=request.flow_run_id,
                after=after,
                limit=size + 1,
            )
        page, more = commands[:size], len(commands) > size
        return effect_v1.ListCommandsResponse(
            commands=[command_proto(c) for c in page],
            next_page_token=encode_page_token(page[-1]) if more else "",
        )

    async def GetReceipt(self, request: Any, context: Context) -> Any:
        scope = _request_scope(request)
        if not request.command_id:
            raise InvalidArgumentError("command_id is required", field_path="command_id")
        if request.outcome_version < 0:
            raise InvalidArgumentError("outcome_version must be >= 0", field_path="outcome_version")
        async with transaction(self._engine, readonly=True) as conn:
            command = await get_command_txn(conn, scope, command_id=request.command_id)
            receipt = (
                None
                if command is None
                else await get_receipt_txn(
                    conn, scope, request.command_id, int(request.outcome_version)
                )
            )
        if command is None or receipt is None:
            raise NotFoundError("CompletionReceipt", request.command_id)
        return effect_v1.GetReceiptResponse(receipt=receipt_proto(receipt, command))


def _accept_response(accepted: Accepted) -> Any:
    return effect_v1.AcceptHandoffResponse(
        fence=fence_proto(accepted.fence),
        command=command_proto(accepted.command),
        duplicate=accepted.duplicate,
    )


def build_effect_owner_service(
    engine: AsyncEngine,
    served_kinds: Collection[str],
    *,
    on_accepted: Callable[[CommandRecord], None] | None = None,
    seats: CommandSeats | None = None,
) -> ServiceRegistration:
    """The registration of :class:`EffectOwnerServicer` (``on_accepted``: called after a
    new command committed ``ACCEPTED``; ``seats``: pre-claimed commands, ADR 0008)."""
    return ServiceRegistration(
        SERVICE_NAME,
        effect_v1.add_EffectOwnerServiceServicer_to_server,
        EffectOwnerServicer(engine, served_kinds, on_accepted=on_accepted, seats=seats),
    )
