"""What this binary is on the bridge path, and the two enforcement points that read it.

* **Binaries carry their protocol generation** (§20.3): :data:`BINARY_VERSION` and
  :data:`BINARY_WRITE_PROTOCOL_GENERATION` are build constants; :data:`RELEASES` maps
  every released version to the ``FlowInterviewWriteProtocolGeneration`` its binaries
  implement (0 = pre-bridge: no owner gate, no typed legacy store). ``flowctl deploy
  rollback-check`` reads the manifest; an unknown version cannot prove bridge capability.
* **V2 admission** (:func:`require_v2_admission_txn`) is checked inside the very
  transaction that would insert a ``FlowRuntimeV2`` root
  (``runtime_svc.kernel.store_create``): impossible before both gates, on a pre-bridge
  binary, under quarantine, or while admission is disabled.
* **Start-up** (:func:`runtime_svc.migration.fleet.register_writer`) refuses a binary the
  control record has left behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncConnection

from services.errors import FailedPreconditionError

if TYPE_CHECKING:  # the control record decodes kernel enums: a runtime import is a cycle
    from runtime_svc.migration.control import DeploymentControl

__all__ = [
    "BINARY_VERSION",
    "BINARY_WRITE_PROTOCOL_GENERATION",
    "RELEASES",
    "BinaryRefusedError",
    "V2AdmissionClosedError",
    "binary_generation",
    "release_generation",
    "require_v2_admission",
    "require_v2_admission_txn",
]

#: This build's release version (``pyproject.toml`` carries the same; a test checks).
BINARY_VERSION = "0.2.0"
#: The ``FlowInterviewWriteProtocolGeneration`` this build implements (bridge: 1).
BINARY_WRITE_PROTOCOL_GENERATION = 1
#: Released version -> write-protocol generation of its binaries.
RELEASES: Mapping[str, int] = {
    # 0.1.0 predates the bridge: no owner-aware legacy paths, no start guard, and it
    # cannot decode or drain LegacyInterpreter runs.
    "0.1.0": 0,
    "0.2.0": 1,
}


def binary_generation() -> int:
    """This process's generation (read at call time, so a test can build a pre-bridge
    binary by overriding the constant before start-up)."""
    return BINARY_WRITE_PROTOCOL_GENERATION


def release_generation(version: str) -> int | None:
    """The generation of a released version (``None``: unknown release)."""
    return RELEASES.get(version.strip().removeprefix("v"))


class V2AdmissionClosedError(FailedPreconditionError):
    """A new FlowRuntimeV2 run may not be admitted now (nothing was written)."""

    def __init__(self, refusal: str) -> None:
        super().__init__(
            f"new Flow Runtime V2 runs are not admitted: {refusal}",
            reason=f"v2_admission.{refusal}",
        )
        self.refusal = refusal


class BinaryRefusedError(FailedPreconditionError):
    """This binary may not start against this deployment."""

    def __init__(self, refusal: str, generation: int) -> None:
        super().__init__(
            f"refusing to start a write-protocol generation {generation} binary: {refusal}",
            reason=f"binary_refused.{refusal}",
        )
        self.refusal = refusal


async def require_v2_admission_txn(conn: AsyncConnection, *, generation: int | None = None) -> None:
    """Fail closed unless a new V2 run may be admitted (read in the caller's transaction).

    Raises:
        V2AdmissionClosedError: see :func:`runtime_svc.migration.gates.v2_admission_refusal`.
        FailedPreconditionError: the control record is missing.
    """
    # Imported here: the kernel's create path imports this module, and the control record
    # decodes kernel enums — a module-level import would be a cycle.
    from runtime_svc.migration.control import read_control_txn

    require_v2_admission(await read_control_txn(conn), generation=generation)


def require_v2_admission(control: DeploymentControl, *, generation: int | None = None) -> None:
    """:func:`require_v2_admission_txn` on a control record the caller already read in
    its transaction (the run-creation path reads it with the plan, one statement).

    Raises:
        V2AdmissionClosedError: see :func:`runtime_svc.migration.gates.v2_admission_refusal`.
    """
    from runtime_svc.migration.gates import v2_admission_refusal

    refusal = v2_admission_refusal(
        control, binary_generation() if generation is None else generation
    )
    if refusal is not None:
        raise V2AdmissionClosedError(refusal)
