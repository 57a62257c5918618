"""Assemble :class:`runtime_svc.compiler.CompilerInputs` from a catalog snapshot (§7.1).

The compiler's documented input contract is JSON (``CompilerInputs.from_dict``; the
shape of ``tests/flows/_inputs``). Both producers of inputs speak it:

* the runtime service: :mod:`runtime_svc.catalog_client` turns the catalog's protos
  (work binding, sealed generation, entries, metadata view) into a
  :class:`CatalogSnapshot` of JSON documents;
* ``flowctl flow compile --inputs DIR``: reads the same documents from files.

So activation, inventory and the CLI feed one function the same shape, and the compiler
is the only place that interprets it (§7.4: "Metadata activation and control-plane
verification invoke the same compiler contract").

Two facts the catalog's ``MetadataView`` proto does not carry are filled in here:

* a trigger subscription names a Flow by API name only; the subscription applies to the
  version being compiled (or, at admission, the active version), so
  :func:`build_compiler_inputs` pins ``flow_version`` from ``flow_versions``; a
  subscription of any other Flow gets version 0, which matches no Flow version;
* wait-producer kinds are registered with the runtime (§14.1), not published in the
  view; the runtime's registry is added when the snapshot has none.

Pure: no I/O, no generated protos.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime_svc.compiler import CompilerInputs
from services.errors import FailedPreconditionError

__all__ = [
    "DEFAULT_WAIT_PRODUCERS",
    "CatalogSnapshot",
    "build_compiler_inputs",
    "pin_subscription_versions",
]

#: The external signal kinds event waits may name when the runtime is configured with
#: its defaults (``runtime_svc.waits.registry.ProducerRegistry.compiler_producers``; the
#: built-in timer, record-change and effect-completion producers are not event waits).
#: Deployments configure more with ``FLOW_RUNTIME_SIGNAL_KINDS``.
DEFAULT_WAIT_PRODUCERS: tuple[Mapping[str, str], ...] = (
    {"kind": "external.signal", "reconciliation": "event"},
)


@dataclass(frozen=True)
class CatalogSnapshot:
    """One sealed generation, its binding and its metadata view, as compiler JSON.

    Attributes:
        binding: ``RuntimeWorkBindingRef`` document (the complete binding tuple).
        generation: ``CatalogGenerationRef`` document.
        entries: ``CapabilityEntryView`` documents, sorted by action type.
        metadata_view: ``MetadataViewInput`` document; a trigger subscription whose
            ``flow_version`` is ``None`` applies to whichever version is compiled.
    """

    binding: Mapping[str, Any]
    generation: Mapping[str, Any]
    entries: tuple[Mapping[str, Any], ...]
    metadata_view: Mapping[str, Any]

    @property
    def generation_id(self) -> str:
        """Catalog generation identity."""
        return str(self.generation["generation_id"])

    @property
    def catalog_digest(self) -> str:
        """Sealed catalog digest."""
        return str(self.generation["catalog_digest"])

    @property
    def metadata_view_digest(self) -> str:
        """Content digest of the bound metadata view."""
        return str(self.binding["metadata_view_digest"])

    @property
    def binding_digest(self) -> str:
        """``RuntimeWorkBindingDigest``."""
        return str(self.binding["binding_digest"])

    def entry(self, action_type: str) -> Mapping[str, Any] | None:
        """The entry document of ``action_type``, or ``None``."""
        return next((e for e in self.entries if e.get("action_type") == action_type), None)


def pin_subscription_versions(
    view: Mapping[str, Any], flow_versions: Mapping[str, int]
) -> dict[str, Any]:
    """A copy of ``view`` whose version-less subscriptions name a concrete version.

    Subscriptions that already carry a version (CLI input files) are kept as they are.
    """
    subs = []
    for s in view.get("trigger_subscriptions") or ():
        if s.get("flow_version") is None:
            s = {**s, "flow_version": flow_versions.get(str(s.get("flow_api_name")), 0)}
        subs.append(s)
    return {**view, "trigger_subscriptions": subs}


def build_compiler_inputs(
    snapshot: CatalogSnapshot,
    policy: Mapping[str, Any],
    subflows: Iterable[Mapping[str, Any]] = (),
    *,
    flow_versions: Mapping[str, int] | None = None,
    wait_producers: Sequence[Mapping[str, str]] = DEFAULT_WAIT_PRODUCERS,
) -> CompilerInputs:
    """The compiler's inputs for one compile.

    Args:
        snapshot: the catalog generation, binding and view.
        policy: the policy generation document including its ``version``.
        subflows: every Flow document a Subflow element may (transitively) call.
        flow_versions: API name → version for version-less trigger subscriptions.
        wait_producers: registered wait-producer kinds, used when the view lists none.

    Raises:
        FailedPreconditionError: the catalog documents are not a usable compiler input
            (a catalog contract violation; the compile cannot start).
    """
    view = pin_subscription_versions(snapshot.metadata_view, flow_versions or {})
    if not view.get("wait_producers"):
        view["wait_producers"] = [dict(p) for p in wait_producers]
    document = {
        "binding": dict(snapshot.binding),
        "catalog": {
            "generation": dict(snapshot.generation),
            "entries": [dict(e) for e in snapshot.entries],
        },
        "metadata_view": view,
        "policy": dict(policy),
        "subflows": [dict(s) for s in subflows],
    }
    try:
        return CompilerInputs.from_dict(document)
    except (ValueError, TypeError, KeyError) as exc:
        raise FailedPreconditionError(
            f"the catalog inputs are not a valid compiler input: {exc}",
            reason="compiler_inputs_invalid",
        ) from exc
