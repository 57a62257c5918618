"""A real catalog server on loopback port 0 over a migrated database, and a typed client.

The server runs :func:`services.grpc_server.start_server` with the production servicers
(``catalog_svc.app.build_services``) in a background thread with its own event loop, so
tests call it with the plain synchronous gRPC stub exactly as any client would. One
server (and one database) serves a whole test module; every test works in its own
freshly named org(s), so tests never see each other's rows.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from catalog_svc.api.servicer import CatalogServicer
from catalog_svc.app import SERVICE_NAMES
from catalog_svc.service import CatalogService
from catalog_svc.store import CatalogRepository
from services import db, migrate
from services.auth import (
    CredentialVerifier,
    generate_keypair,
)
from services.config import ServiceName
from services.digest import versioned_digest
from services.grpc_server import ServiceRegistration, start_server
from services.proto import catalog_v1, common_v1
from tests.support.servers import BackgroundServers, workload_metadata
from tests.support.servers import Scope as Scope
from tests.support.servers import error_detail as error_detail
from tests.support.servers import new_id as new_id

KEY_ID = "catalog-test"


class CatalogServer(BackgroundServers):
    """The catalog service in a background thread; :meth:`stop` is idempotent."""

    def __init__(self, db_url: str, data_dir: Path) -> None:
        super().__init__(data_dir, {"FLOW_CATALOG_DB_URL": db_url}, name="catalog-server")
        self.db_url = db_url
        self.private_key, public = generate_keypair()
        self._verifier = CredentialVerifier({KEY_ID: public}, ServiceName.CATALOG)
        self.port = 0
        #: Generation ids the server assigns next (tests force id collisions across
        #: scopes with it); random ``gen-<uuid>`` ids once it is empty.
        self.generation_ids: list[str] = []

    async def serve(self) -> None:
        engine = db.create_engine(self.db_url, pool_size=4)
        # What catalog_svc.app.build_services wires, plus the generation-id seam.
        service = CatalogService(CatalogRepository(engine), new_generation_id=self._next_id)
        registration = ServiceRegistration(
            SERVICE_NAMES[0],
            catalog_v1.add_CatalogServiceServicer_to_server,
            CatalogServicer(service),
        )
        try:
            running = await start_server(
                self.cfg(ServiceName.CATALOG), [registration], verifier=self._verifier
            )
            self.port = running.port
            await self.serving()
            await running.stop(0)
        finally:
            await engine.dispose()

    def _next_id(self) -> str:
        return self.generation_ids.pop(0) if self.generation_ids else f"gen-{uuid.uuid4().hex}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def running_catalog(db_url: str, data_dir: Path) -> Iterator[CatalogServer]:
    """Migrate ``db_url`` and serve the catalog over it for the block."""
    asyncio.run(migrate.upgrade(db_url, "catalog_svc"))
    server = CatalogServer(db_url, data_dir).start()
    try:
        yield server
    finally:
        server.stop()


# --- client side ------------------------------------------------------------------------


@dataclass
class Client:
    """A synchronous stub plus credential minting for any (partial) scope."""

    channel: grpc.Channel
    private_key: Ed25519PrivateKey
    stub: Any = field(init=False)

    def __post_init__(self) -> None:
        self.stub = catalog_v1.CatalogServiceStub(self.channel)

    def md(
        self,
        org: str,
        inst: str | None = None,
        cap: str | None = None,
        digest: str | None = None,
    ) -> tuple[tuple[str, str], ...]:
        return workload_metadata(
            self.private_key,
            KEY_ID,
            ServiceName.CATALOG,
            org,
            inst,
            cap,
            digest,
            subject="catalog-test",
        )

    def scoped(self, scope: Scope) -> tuple[tuple[str, str], ...]:
        return self.md(
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
        )

    def call(self, rpc: str, request: Any, md: Sequence[tuple[str, str]]) -> Any:
        return getattr(self.stub, rpc)(request, metadata=md, timeout=30)

    # -- building blocks -------------------------------------------------------------------

    def publish_view(
        self, org: str, inst: str, view: catalog_v1.MetadataView | None = None
    ) -> catalog_v1.MetadataView:
        view = view or demo_view()
        view.org_id, view.app_installation_id = org, inst
        resp = self.call(
            "PublishMetadataView",
            catalog_v1.PublishMetadataViewRequest(request_id=new_id("req"), org_id=org, view=view),
            self.md(org, inst),
        )
        return resp.view

    def register_binding(
        self, org: str, inst: str, cap: str, view_digest: str, **overrides: Any
    ) -> common_v1.RegisteredWorkBinding:
        binding = binding_proto(org, inst, cap, view_digest, **overrides)
        resp = self.call(
            "RegisterWorkBinding",
            catalog_v1.RegisterWorkBindingRequest(
                request_id=new_id("req"), org_id=org, binding=binding
            ),
            self.md(org, inst, cap),
        )
        return resp.work_binding

    def tenant(
        self,
        org: str | None = None,
        inst: str = "inst-1",
        cap: str = "cap-flow",
        **overrides: Any,
    ) -> Scope:
        """Publish the demo view and register a binding; the complete work scope."""
        org = org or new_id("org")
        view = self.publish_view(org, inst)
        registered = self.register_binding(
            org, inst, cap, view.runtime_metadata_view_digest, **overrides
        )
        return Scope(org, inst, cap, registered.runtime_work_binding_digest)

    def open(self, scope: Scope) -> catalog_v1.CatalogGeneration:
        resp = self.call(
            "OpenGeneration",
            catalog_v1.OpenGenerationRequest(
                request_id=new_id("req"), scope=scope.proto(), contract_version=1
            ),
            self.scoped(scope),
        )
        return resp.generation

    def submit(
        self, scope: Scope, generation_id: str, entry: catalog_v1.SubmitEntryRequest
    ) -> catalog_v1.SubmitEntryResponse:
        req = catalog_v1.SubmitEntryRequest()
        req.CopyFrom(entry)
        req.request_id = req.request_id or new_id("req")
        req.scope.CopyFrom(scope.proto())
        req.catalog_generation_id = generation_id
        return self.call("SubmitEntry", req, self.scoped(scope))

    def seal(self, scope: Scope, generation_id: str) -> catalog_v1.CatalogGeneration:
        resp = self.call(
            "SealGeneration",
            catalog_v1.SealGenerationRequest(
                request_id=new_id("req"), scope=scope.proto(), catalog_generation_id=generation_id
            ),
            self.scoped(scope),
        )
        return resp.generation

    def build(
        self, scope: Scope, entries: Sequence[catalog_v1.SubmitEntryRequest]
    ) -> catalog_v1.CatalogGeneration:
        gen = self.open(scope)
        for entry in entries:
            self.submit(scope, gen.catalog_generation_id, entry)
        return self.seal(scope, gen.catalog_generation_id)

    def get_generation(self, scope: Scope, generation_id: str) -> catalog_v1.CatalogGeneration:
        resp = self.call(
            "GetGeneration",
            catalog_v1.GetGenerationRequest(
                scope=scope.proto(), catalog_generation_id=generation_id
            ),
            self.scoped(scope),
        )
        return resp.generation

    def list_entries(
        self, scope: Scope, generation_id: str, digest: str, page_size: int = 0
    ) -> list[catalog_v1.CatalogEntry]:
        out: list[catalog_v1.CatalogEntry] = []
        token = ""
        for _ in range(100):
            resp = self.call(
                "ListEntries",
                catalog_v1.ListEntriesRequest(
                    scope=scope.proto(),
                    catalog_generation_id=generation_id,
                    catalog_digest=digest,
                    page_size=page_size,
                    page_token=token,
                ),
                self.scoped(scope),
            )
            out.extend(resp.entries)
            token = resp.next_page_token
            if not token:
                return out
        raise AssertionError("too many pages")


# --- request factories -------------------------------------------------------------------


def demo_view() -> catalog_v1.MetadataView:
    """Account/Contact schema, one lock-relevant relationship, two triggers, three actions."""
    F = catalog_v1.FieldType
    return catalog_v1.MetadataView(
        schema_generation=3,
        objects=[
            catalog_v1.ObjectSchema(
                api_name="Account",
                label="Account",
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="Name", type=F.FIELD_TYPE_STRING, required=True, max_length=80
                    ),
                    catalog_v1.FieldSchema(
                        api_name="Balance", type=F.FIELD_TYPE_DECIMAL, precision=18, scale=2
                    ),
                ],
            ),
            catalog_v1.ObjectSchema(
                api_name="Contact",
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="AccountId",
                        type=F.FIELD_TYPE_REFERENCE,
                        reference_object_api_name="Account",
                    ),
                    catalog_v1.FieldSchema(
                        api_name="Email", type=F.FIELD_TYPE_TEXT, max_length=320
                    ),
                ],
            ),
        ],
        relationships=[
            catalog_v1.Relationship(
                name="AccountId",
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_LOOKUP,
                parent_object_api_name="Account",
                child_object_api_name="Contact",
                child_field_api_name="AccountId",
                lock_relevant=True,
            )
        ],
        trigger_subscriptions=[
            catalog_v1.TriggerSubscription(
                flow_api_name="Welcome",
                object_api_name="Contact",
                timing=common_v1.TriggerTiming.TRIGGER_TIMING_AFTER_SAVE,
                events=[common_v1.TriggerEvent.TRIGGER_EVENT_CREATE],
                entry_condition="ISCHANGED(Email)",
            )
        ],
        actions=[
            catalog_v1.ActionMetadata(
                action_type="core.send_email",
                label="Send e-mail",
                inputs=[
                    catalog_v1.ActionParameter(name="to", type=F.FIELD_TYPE_STRING, required=True),
                    catalog_v1.ActionParameter(name="message_id", type=F.FIELD_TYPE_STRING),
                ],
            ),
            catalog_v1.ActionMetadata(action_type="core.update_record", label="Update record"),
            catalog_v1.ActionMetadata(action_type="core.format_name", label="Format name"),
        ],
    )


def binding_proto(
    org: str, inst: str, cap: str, view_digest: str, **overrides: Any
) -> common_v1.RuntimeWorkBinding:
    values: dict[str, Any] = {
        "org_id": org,
        "app_installation_id": inst,
        "runtime_capability_id": cap,
        "catalog_revision": 7,
        "schema_generation": 3,
        "engine_generation": 2,
        "catalog_snapshot_digest": versioned_digest("catalog_snapshot", {"rev": 7}),
        "runtime_metadata_view_digest": view_digest,
    }
    values.update(overrides)
    return common_v1.RuntimeWorkBinding(**values)


def pure_descriptor() -> common_v1.CapabilityDescriptor:
    C = common_v1
    return C.CapabilityDescriptor(
        execution_class=C.ExecutionClass.EXECUTION_CLASS_PURE_COMPUTE,
        transaction_policy=C.TransactionPolicy.TRANSACTION_POLICY_PROFILE_DEPENDENT,
        replay_policy=C.ReplayPolicy.REPLAY_POLICY_DETERMINISTIC_REPLAY,
        fanout_bound=C.FanoutBound(
            kind=C.FanoutBoundKind.FANOUT_BOUND_KIND_STATIC_MAXIMUM, static_maximum=1
        ),
        read_contract=C.ReadContract.READ_CONTRACT_CHECKPOINT_ONLY,
        lock_plan_contract=C.LockPlanContract(kind=C.LockPlanKind.LOCK_PLAN_KIND_STATIC_KEYS),
        effect_owner=C.EffectOwnerContract(owner_class=C.EffectOwnerClass.EFFECT_OWNER_CLASS_NONE),
        idempotency_policy=C.IdempotencyPolicy(),
        output_durability=C.OutputDurability.OUTPUT_DURABILITY_EPHEMERAL,
        security_policy=C.SecurityPolicy(
            principal_mode=C.PrincipalMode.PRINCIPAL_MODE_INITIATING_PRINCIPAL,
            reauthorization_policy=C.ReauthorizationPolicy.REAUTHORIZATION_POLICY_FAULT_PATH,
        ),
        minimum_capability_version=1,
    )


def mutation_descriptor() -> common_v1.CapabilityDescriptor:
    C = common_v1
    return C.CapabilityDescriptor(
        execution_class=C.ExecutionClass.EXECUTION_CLASS_RECORD_MUTATION,
        transaction_policy=C.TransactionPolicy.TRANSACTION_POLICY_PROFILE_DEPENDENT,
        replay_policy=C.ReplayPolicy.REPLAY_POLICY_DETERMINISTIC_REPLAY,
        fanout_bound=C.FanoutBound(
            kind=C.FanoutBoundKind.FANOUT_BOUND_KIND_STATIC_MAXIMUM, static_maximum=10
        ),
        read_contract=C.ReadContract.READ_CONTRACT_CURRENT_TRANSACTIONAL,
        lock_plan_contract=C.LockPlanContract(
            kind=C.LockPlanKind.LOCK_PLAN_KIND_STATIC_KEYS,
            static_keys=[
                C.ResourceKey(
                    resource_class="record",
                    namespace="Account",
                    record_identity="$trigger.Id",
                    ordering_version=1,
                ),
                C.ResourceKey(resource_class="parent", namespace="Account", ordering_version=1),
            ],
            resource_classes=["record", "parent"],
            max_keys=4,
        ),
        effect_owner=C.EffectOwnerContract(owner_class=C.EffectOwnerClass.EFFECT_OWNER_CLASS_NONE),
        idempotency_policy=C.IdempotencyPolicy(),
        output_durability=C.OutputDurability.OUTPUT_DURABILITY_CHECKPOINTED,
        security_policy=C.SecurityPolicy(
            principal_mode=C.PrincipalMode.PRINCIPAL_MODE_INITIATING_PRINCIPAL,
            reauthorization_policy=C.ReauthorizationPolicy.REAUTHORIZATION_POLICY_FAULT_PATH,
        ),
        minimum_capability_version=2,
    )


def effect_descriptor() -> common_v1.CapabilityDescriptor:
    C = common_v1
    return C.CapabilityDescriptor(
        execution_class=C.ExecutionClass.EXECUTION_CLASS_EXTERNAL_EFFECT,
        transaction_policy=C.TransactionPolicy.TRANSACTION_POLICY_TRANSACTION_FORBIDDEN,
        replay_policy=C.ReplayPolicy.REPLAY_POLICY_IDEMPOTENT_BY_KEY,
        fanout_bound=C.FanoutBound(
            kind=C.FanoutBoundKind.FANOUT_BOUND_KIND_STATIC_MAXIMUM, static_maximum=1
        ),
        read_contract=C.ReadContract.READ_CONTRACT_CHECKPOINT_ONLY,
        lock_plan_contract=C.LockPlanContract(kind=C.LockPlanKind.LOCK_PLAN_KIND_UNKNOWN),
        effect_owner=C.EffectOwnerContract(
            owner_class=C.EffectOwnerClass.EFFECT_OWNER_CLASS_INTEGRATION_WORK,
            effect_owner_kind="email.smtp",
        ),
        idempotency_policy=C.IdempotencyPolicy(
            key_required=True,
            key_shape="mail:${run.id}:${step.key}:${input.to}",
            uniqueness_scope=C.IdempotencyScope.IDEMPOTENCY_SCOPE_RUNTIME_WORK_SCOPE,
        ),
        output_durability=C.OutputDurability.OUTPUT_DURABILITY_OWNER_RECEIPT,
        security_policy=C.SecurityPolicy(
            principal_mode=C.PrincipalMode.PRINCIPAL_MODE_INITIATING_PRINCIPAL,
            reauthorization_policy=C.ReauthorizationPolicy.REAUTHORIZATION_POLICY_TERMINAL_FAILURE,
        ),
        minimum_capability_version=1,
    )


SOURCE = catalog_v1.EntrySource


def entry(
    action_type: str,
    descriptor: common_v1.CapabilityDescriptor,
    *,
    source: int = SOURCE.ENTRY_SOURCE_PLATFORM,
    owner: str = "platform:core",
    handler_ref: str | None = None,
    version: str = "1.0.0",
    release_digest: str = "",
    contract_only: bool = False,
) -> catalog_v1.SubmitEntryRequest:
    hb = common_v1.HandlerBinding(owner_registration_id=owner)
    if not contract_only:
        hb.handler_ref = handler_ref or f"python:handlers:{action_type.replace('.', '_')}"
        if release_digest:
            hb.service_release_digest = release_digest
        else:
            hb.handler_implementation_version = version
    return catalog_v1.SubmitEntryRequest(
        action_type=action_type,
        source=source,
        descriptor=descriptor,
        handler_binding=hb,
        contract_only=contract_only,
    )


def demo_entries() -> list[catalog_v1.SubmitEntryRequest]:
    """A pure platform action, a record mutation and an external effect with an owner."""
    return [
        entry("core.format_name", pure_descriptor()),
        entry("core.update_record", mutation_descriptor()),
        entry(
            "core.send_email",
            effect_descriptor(),
            source=SOURCE.ENTRY_SOURCE_EXTENSION,
            owner="ext:mail",
            handler_ref="python:mail.handlers:send",
            version="2.3.0",
        ),
    ]
