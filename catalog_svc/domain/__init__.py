"""Pure domain logic of the catalog service (§7.1, §7.3, §8, §10.0).

No SQL, no gRPC, no generated protos: frozen values, validation that collects every
issue, the versioned digest chain, and the generation builder as pure decisions.

Modules:
    binding: ``RuntimeWorkBinding`` and its trusted ``RuntimeWorkScope``.
    metadata_view: content-addressed ``RuntimeMetadataView``.
    metadata_schema: its value types (objects, fields, triggers, actions).
    capability: the eleven-field ``CapabilityDescriptor`` and its rules.
    capability_types: its enums and value types.
    idempotency_key: grammar of idempotency key shapes.
    broadening: when a handler broadens its owner's declared capability.
    entry: submissions, admitted entries, ``BindingFingerprint`` and ``EntryDigest``.
    generation: ``open_generation`` / ``submit_entry`` / ``seal`` decisions.
    sealed: the sealed artifact and ``CatalogDigest``.
    availability: runtime handler tuples and the §8.4 release rule.
    diagnostics: issue values, codes and the one validation error.
    ids: identifier types, grammars and digest kinds.
"""

from __future__ import annotations

from .availability import (
    BindingGap,
    BindingGapReason,
    RuntimeHandlerTuple,
    binding_gaps,
    required_tuples,
    verify_runtime_binary,
)
from .binding import RuntimeWorkBinding, RuntimeWorkScope, WorkScopeLike
from .broadening import broadened_fields
from .capability import CapabilityDescriptor
from .capability_types import (
    EffectOwnerClass,
    EffectOwnerContract,
    ExecutionClass,
    FanoutBound,
    FanoutBoundKind,
    IdempotencyPolicy,
    IdempotencyScope,
    LockPlanContract,
    LockPlanKind,
    OutputDurability,
    PrincipalMode,
    ReadContract,
    ReauthorizationPolicy,
    ReplayPolicy,
    SecurityPolicy,
    StaticResourceKey,
    TransactionPolicy,
)
from .diagnostics import (
    CONFLICT_CODES,
    CatalogDiagnostic,
    Diagnostic,
    DiagnosticCode,
    DomainValidationError,
)
from .entry import (
    ActionOwner,
    CatalogEntry,
    CatalogEntrySubmission,
    HandlerBinding,
    OwnerKind,
    compute_binding_fingerprint,
    compute_entry_digest,
)
from .generation import (
    Accepted,
    GenerationDraft,
    GenerationState,
    IdempotentDuplicate,
    Rejected,
    SealDecision,
    Sealed,
    SubmitDecision,
    open_generation,
    seal,
    submit_entry,
)
from .idempotency_key import KeyShapeError, parse_key_shape, shape_input_names
from .ids import (
    BINDING_FINGERPRINT_KIND,
    CATALOG_DIGEST_KIND,
    CONTRACT_VERSION,
    DESCRIPTOR_DIGEST_KIND,
    ENTRY_DIGEST_KIND,
    METADATA_VIEW_DIGEST_KIND,
    SUPPORTED_CONTRACT_VERSIONS,
    WORK_BINDING_DIGEST_KIND,
    ActionType,
    BindingFingerprint,
    CatalogDigest,
    CatalogGenerationId,
    DescriptorDigest,
    EntryDigest,
    HandlerRef,
    RuntimeMetadataViewDigest,
    RuntimeWorkBindingDigest,
    normalize_action_type,
    normalize_handler_ref,
)
from .metadata_schema import (
    ActionMetadata,
    ActionParameter,
    FieldSchema,
    FieldType,
    LockRelationship,
    ObjectSchema,
    TriggerEvent,
    TriggerSubscription,
    TriggerTiming,
)
from .metadata_view import RuntimeMetadataView
from .sealed import SealedGeneration, compute_catalog_digest

__all__ = [
    "BINDING_FINGERPRINT_KIND",
    "CATALOG_DIGEST_KIND",
    "CONFLICT_CODES",
    "CONTRACT_VERSION",
    "DESCRIPTOR_DIGEST_KIND",
    "ENTRY_DIGEST_KIND",
    "METADATA_VIEW_DIGEST_KIND",
    "SUPPORTED_CONTRACT_VERSIONS",
    "WORK_BINDING_DIGEST_KIND",
    "Accepted",
    "ActionMetadata",
    "ActionOwner",
    "ActionParameter",
    "ActionType",
    "BindingFingerprint",
    "BindingGap",
    "BindingGapReason",
    "CapabilityDescriptor",
    "CatalogDiagnostic",
    "CatalogDigest",
    "CatalogEntry",
    "CatalogEntrySubmission",
    "CatalogGenerationId",
    "DescriptorDigest",
    "Diagnostic",
    "DiagnosticCode",
    "DomainValidationError",
    "EffectOwnerClass",
    "EffectOwnerContract",
    "EntryDigest",
    "ExecutionClass",
    "FanoutBound",
    "FanoutBoundKind",
    "FieldSchema",
    "FieldType",
    "GenerationDraft",
    "GenerationState",
    "HandlerBinding",
    "HandlerRef",
    "IdempotencyPolicy",
    "IdempotencyScope",
    "IdempotentDuplicate",
    "KeyShapeError",
    "LockPlanContract",
    "LockPlanKind",
    "LockRelationship",
    "ObjectSchema",
    "OutputDurability",
    "OwnerKind",
    "PrincipalMode",
    "ReadContract",
    "ReauthorizationPolicy",
    "Rejected",
    "ReplayPolicy",
    "RuntimeHandlerTuple",
    "RuntimeMetadataView",
    "RuntimeMetadataViewDigest",
    "RuntimeWorkBinding",
    "RuntimeWorkBindingDigest",
    "RuntimeWorkScope",
    "SealDecision",
    "Sealed",
    "SealedGeneration",
    "SecurityPolicy",
    "StaticResourceKey",
    "SubmitDecision",
    "TransactionPolicy",
    "TriggerEvent",
    "TriggerSubscription",
    "TriggerTiming",
    "WorkScopeLike",
    "binding_gaps",
    "broadened_fields",
    "compute_binding_fingerprint",
    "compute_catalog_digest",
    "compute_entry_digest",
    "normalize_action_type",
    "normalize_handler_ref",
    "open_generation",
    "parse_key_shape",
    "required_tuples",
    "seal",
    "shape_input_names",
    "submit_entry",
    "verify_runtime_binary",
]
