"""Typed gRPC contracts of the Nexus Flow Runtime.

The code under ``services/proto/nexus/`` is generated from ``protos/`` by
``scripts/gen_protos.py`` (``make proto``) and is not committed. Import the
per-package namespaces from here instead of the ``*_pb2`` modules::

    from services.proto import common_v1, runtime_v1

    request = runtime_v1.StartRunRequest(
        request_id="...",
        scope=common_v1.TrustedRuntimeWorkScope(org_id="org-1", ...),
    )

Each namespace re-exports every message, enum, servicer, stub and
``add_*Servicer_to_server`` function of its proto package
(``nexus.flow.<name>.v1``).
"""

from __future__ import annotations

from services.proto.nexus.flow.catalog import v1 as catalog_v1
from services.proto.nexus.flow.common import v1 as common_v1
from services.proto.nexus.flow.effect import v1 as effect_v1
from services.proto.nexus.flow.runtime import v1 as runtime_v1

__all__ = [
    "catalog_v1",
    "common_v1",
    "effect_v1",
    "runtime_v1",
]
