"""Pin the public surface of ``catalog_svc.domain`` and keep it pure."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import catalog_svc.domain as domain

EXPECTED = {
    # values and decisions
    "Accepted",
    "ActionMetadata",
    "ActionOwner",
    "ActionParameter",
    "BindingGap",
    "CapabilityDescriptor",
    "CatalogDiagnostic",
    "CatalogEntry",
    "CatalogEntrySubmission",
    "Diagnostic",
    "EffectOwnerContract",
    "FanoutBound",
    "FieldSchema",
    "GenerationDraft",
    "HandlerBinding",
    "IdempotencyPolicy",
    "IdempotentDuplicate",
    "LockPlanContract",
    "LockRelationship",
    "ObjectSchema",
    "Rejected",
    "RuntimeHandlerTuple",
    "RuntimeMetadataView",
    "RuntimeWorkBinding",
    "RuntimeWorkScope",
    "Sealed",
    "SealedGeneration",
    "SecurityPolicy",
    "StaticResourceKey",
    "TriggerSubscription",
    "WorkScopeLike",
    "SealDecision",
    "SubmitDecision",
    # enums
    "BindingGapReason",
    "DiagnosticCode",
    "EffectOwnerClass",
    "ExecutionClass",
    "FanoutBoundKind",
    "FieldType",
    "GenerationState",
    "IdempotencyScope",
    "LockPlanKind",
    "OutputDurability",
    "OwnerKind",
    "PrincipalMode",
    "ReadContract",
    "ReauthorizationPolicy",
    "ReplayPolicy",
    "TransactionPolicy",
    "TriggerEvent",
    "TriggerTiming",
    # identifier types and constants
    "ActionType",
    "BindingFingerprint",
    "CatalogDigest",
    "CatalogGenerationId",
    "DescriptorDigest",
    "EntryDigest",
    "HandlerRef",
    "RuntimeMetadataViewDigest",
    "RuntimeWorkBindingDigest",
    "BINDING_FINGERPRINT_KIND",
    "CATALOG_DIGEST_KIND",
    "CONFLICT_CODES",
    "CONTRACT_VERSION",
    "DESCRIPTOR_DIGEST_KIND",
    "ENTRY_DIGEST_KIND",
    "METADATA_VIEW_DIGEST_KIND",
    "SUPPORTED_CONTRACT_VERSIONS",
    "WORK_BINDING_DIGEST_KIND",
    # errors and functions
    "DomainValidationError",
    "KeyShapeError",
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
}


def test_public_exports_are_pinned() -> None:
    assert set(domain.__all__) == EXPECTED
    assert len(domain.__all__) == len(EXPECTED)
    for name in domain.__all__:
        assert getattr(domain, name) is not None


def test_every_module_has_an_explicit_all_that_resolves() -> None:
    for info in pkgutil.iter_modules(domain.__path__):
        module = importlib.import_module(f"{domain.__name__}.{info.name}")
        assert isinstance(module.__all__, list), info.name
        for name in module.__all__:
            assert hasattr(module, name), (info.name, name)


def test_domain_imports_no_proto_grpc_or_sql() -> None:
    root = Path(domain.__file__).parent
    forbidden = (
        "grpc",
        "sqlalchemy",
        "services.proto",
        "google.protobuf",
        "services.auth",
        "services.db",
    )
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert not name.startswith(forbidden), (path.name, name)
