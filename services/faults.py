"""Named fault points for the crash proofs (ARCHITECTURE §5, STYLE 10).

Every point a test may kill the process at is a :class:`CrashPoint`; code calls
``crash_point(CrashPoint.AFTER_STEP_COMMIT, step_key)`` right after the commit it
guards returned. The hooks are inert unless ``FLOW_CRASH_AT`` is set::

    FLOW_CRASH_AT=<point>              kill at the first call of <point>
    FLOW_CRASH_AT=<point>:<qualifier>  kill only where the call passes that qualifier
                                       (e.g. ``after_step_commit:send_invoice``)

``FLOW_CRASH_AT`` (and ``FLOW_CRASH_MARKER_FILE``) are read once, at import, because a
hook must work before any configuration exists; an unknown point name makes the import
fail, so a misspelt crash test can never run inert. A matching hook writes one line to
stderr, appends ``<point>[:<qualifier>]`` to ``FLOW_CRASH_MARKER_FILE`` (fsync'ed, so the
test can assert *where* the process died), then sends itself ``SIGKILL``.

The in-process variant :func:`raise_connection_lost_after_commit` raises
:class:`~services.errors.CommitOutcomeUnknownError` once after a commit, as a driver
would when the connection drops during ``COMMIT``; only tests arm it
(:func:`connection_lost_after_commit`).

**Step-entry counter** (the durable-workflow seam's Required Proof): with
``FLOW_CRASH_STEP_ENTRY_FILE`` set, :func:`step_entered` appends one line per step entry
(``<step key> <step execution id> <attempt number>``), so a crash test proves how often a
step was entered across a kill and a restart without reading any engine table.

A process with ``FLOW_ENV=production`` refuses to start while any hook is set
(:func:`assert_hooks_allowed`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from services.errors import CommitOutcomeUnknownError

__all__ = [
    "CrashPoint",
    "CrashSpec",
    "FaultHookError",
    "active_crash_spec",
    "assert_hooks_allowed",
    "connection_lost_after_commit",
    "crash_point",
    "parse_crash_at",
    "raise_connection_lost_after_commit",
    "step_entered",
]


class CrashPoint(StrEnum):
    """Every named fault point; the value is the ``FLOW_CRASH_AT`` spelling."""

    AFTER_CLAIM_COMMIT = "after_claim"
    AFTER_RUNNING_COMMIT = "after_running"
    #: Inside the step's business transaction, after BEGIN and its current reads, before
    #: any business lock or write (§22.2 "after begin").
    AFTER_STEP_BEGIN = "after_step_begin"
    #: Inside the step's business transaction, after its business writes, before the
    #: root/step/attempt fence (§22.2 "before fence").
    BEFORE_STEP_FENCE = "before_step_fence"
    BEFORE_STEP_COMMIT = "before_step_commit"
    AFTER_STEP_COMMIT = "after_step_commit"
    #: A step's commit also claimed the run's next step and made it Running for the same
    #: worker (step continuation, docs/adr/0002); its preparation has not begun
    #: (qualifier: the continued step's key). Lease expiry must recover it.
    AFTER_CONTINUATION = "after_continuation"
    #: A wait's resolution also claimed the resumed step and made it Running for a
    #: worker of its process (the pre-claimed wake, docs/adr/0007) and committed; the
    #: worker has not begun its preparation (qualifier: the step's key). Lease expiry
    #: must recover it.
    AFTER_PRECLAIMED_WAKE = "after_preclaimed_wake"
    #: A Bounded Atomic run was created already claimed and Running for its caller
    #: (docs/adr/0005); the business transaction has not begun. Lease expiry must
    #: recover it like any claimed step.
    AFTER_CREATE_CLAIMED = "after_create_claimed"
    DURING_RECOVERY = "during_recovery"
    AFTER_OUTBOX_ENQUEUE = "after_outbox_enqueue"
    #: Owner: the inbox acceptance (fence row + command) committed, before the response.
    AFTER_INBOX_ACCEPT = "after_inbox_accept"
    #: Any outbox dispatcher: the consumer acknowledged the message, before the row is
    #: marked delivered (qualifier: message family). Redelivery must dedupe.
    AFTER_OUTBOX_DELIVERY = "after_outbox_delivery"
    #: Owner: the remote attempt is recorded in flight, before the provider is called
    #: (qualifier: effect owner kind).
    BEFORE_PROVIDER_CALL = "before_provider_call"
    #: Owner: the provider answered, before the outcome is recorded (qualifier: effect
    #: owner kind). Recovery must not send the effect a second time blindly.
    AFTER_PROVIDER_ACCEPTED = "after_provider_accepted"
    #: Owner: the outcome, completion receipt and owner-outbox message committed,
    #: before the receipt is delivered to the runtime.
    AFTER_RECEIPT_COMMIT = "after_receipt_commit"
    SERVER_STARTED = "server_started"
    #: A producer's wake signal committed; its fresh match has not run (§14.2 step 2).
    AFTER_SIGNAL_COMMIT = "after_signal_commit"
    #: A wait's dependency committed; its fresh reconciliation has not run (step 4).
    AFTER_WAIT_COMMIT = "after_wait_commit"
    #: A dependency resolution committed; the scheduler has not claimed the step.
    AFTER_RESOLUTION_COMMIT = "after_resolution_commit"


class FaultHookError(ValueError):
    """``FLOW_CRASH_AT`` is malformed, or hooks are set where they are refused."""


@dataclass(frozen=True)
class CrashSpec:
    """A parsed ``FLOW_CRASH_AT`` value."""

    point: CrashPoint
    qualifier: str | None = None

    def matches(self, point: CrashPoint, qualifier: str | None) -> bool:
        """Exact match: same point, and the same qualifier when the spec names one."""
        return self.point == point and (self.qualifier is None or self.qualifier == qualifier)

    def __str__(self) -> str:
        return _label(self.point, self.qualifier)


def _label(point: CrashPoint, qualifier: str | None) -> str:
    return point.value if qualifier is None else f"{point.value}:{qualifier}"


def parse_crash_at(raw: str) -> CrashSpec | None:
    """Parse ``<point>`` or ``<point>:<qualifier>``; empty means no hook.

    Raises:
        FaultHookError: unknown point or empty qualifier.
    """
    raw = raw.strip()
    if not raw:
        return None
    name, sep, qualifier = raw.partition(":")
    try:
        point = CrashPoint(name)
    except ValueError:
        known = ", ".join(p.value for p in CrashPoint)
        raise FaultHookError(f"FLOW_CRASH_AT: unknown point {name!r} (known: {known})") from None
    if sep and not qualifier:
        raise FaultHookError(f"FLOW_CRASH_AT: empty qualifier in {raw!r}")
    return CrashSpec(point, qualifier if sep else None)


_CRASH_AT: Final = parse_crash_at(os.environ.get("FLOW_CRASH_AT", ""))
_MARKER_FILE: Final = os.environ.get("FLOW_CRASH_MARKER_FILE") or None
_STEP_ENTRY_FILE: Final = os.environ.get("FLOW_CRASH_STEP_ENTRY_FILE") or None


def active_crash_spec() -> CrashSpec | None:
    """The hook this process was started with (None: hooks are inert)."""
    return _CRASH_AT


def crash_point(point: CrashPoint, qualifier: str | None = None) -> None:
    """SIGKILL this process if ``FLOW_CRASH_AT`` names this point (and qualifier)."""
    if _CRASH_AT is None or not _CRASH_AT.matches(point, qualifier):
        return
    label = _label(point, qualifier)
    # os.write, not print/logging: nothing buffered may be lost to the SIGKILL.
    os.write(2, f"FLOW_CRASH_AT: SIGKILL at {label} (pid {os.getpid()})\n".encode())
    if _MARKER_FILE:
        fd = os.open(_MARKER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{label}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def step_entered(step_key: str, step_execution_id: str, attempt_number: int) -> None:
    """Append one step entry to ``FLOW_CRASH_STEP_ENTRY_FILE`` (inert when it is unset).

    One ``write`` of one line with ``O_APPEND``: a SIGKILL right after it cannot lose it
    (the kernel holds the data), and concurrent writers never interleave a line.
    """
    if _STEP_ENTRY_FILE is None:
        return
    fd = os.open(_STEP_ENTRY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{step_key} {step_execution_id} {attempt_number}\n".encode())
    finally:
        os.close(fd)


@dataclass
class _ArmedConnectionLoss:
    spec: CrashSpec | None = None


_CONNECTION_LOSS = _ArmedConnectionLoss()


def raise_connection_lost_after_commit(point: CrashPoint, qualifier: str | None = None) -> None:
    """Raise ``CommitOutcomeUnknownError`` here once, if a test armed this point.

    Call it right after the commit it guards returned: the transaction is durable
    but the caller is told the outcome is unknown, as after a lost COMMIT response.

    Raises:
        CommitOutcomeUnknownError: the point is armed (the hook then disarms itself).
    """
    spec = _CONNECTION_LOSS.spec
    if spec is None or not spec.matches(point, qualifier):
        return
    _CONNECTION_LOSS.spec = None
    raise CommitOutcomeUnknownError(
        f"connection lost after commit (injected at {_label(point, qualifier)})"
    )


@contextmanager
def connection_lost_after_commit(
    point: CrashPoint, qualifier: str | None = None
) -> Iterator[CrashSpec]:
    """Test-only: arm :func:`raise_connection_lost_after_commit` for the block."""
    spec = CrashSpec(point, qualifier)
    _CONNECTION_LOSS.spec = spec
    try:
        yield spec
    finally:
        _CONNECTION_LOSS.spec = None


def assert_hooks_allowed(env: str, *, crash_at: str = "") -> None:
    """Refuse fault hooks in production (ARCHITECTURE §5).

    Args:
        env: ``FLOW_ENV`` (``ServiceConfig.env``).
        crash_at: ``ServiceConfig.crash_at``, checked as well as the process environment.

    Raises:
        FaultHookError: ``env`` is ``production`` and a hook is set or armed, or
            ``crash_at`` is malformed.
    """
    configured = parse_crash_at(crash_at)
    if env != "production":
        return
    hook = _CRASH_AT or configured or _CONNECTION_LOSS.spec
    if hook is None and _STEP_ENTRY_FILE is not None:
        raise FaultHookError(
            "FLOW_CRASH_STEP_ENTRY_FILE is set; it must be empty when FLOW_ENV=production"
        )
    if hook is not None:
        raise FaultHookError(
            f"fault hook {hook} is set; FLOW_CRASH_AT must be empty when FLOW_ENV=production"
        )
