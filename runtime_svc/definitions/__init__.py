"""Flow definitions: versions, runtime policies, plans, activation bindings, inventory and
trigger admission (§7, §9, §16.3, §20.4).

Layers: pure modules (:mod:`.source`, :mod:`.policy`, :mod:`.inputs`, :mod:`.inventory`,
:func:`.admission.select_for_trigger`) never touch SQL, the network or generated protos;
:mod:`.repository` holds the ``_txn`` storage helpers; :mod:`.service` composes them with
the catalog client and the compiler. The gRPC servicer lives in
``runtime_svc.api.definitions``.
"""

from __future__ import annotations

from .activation import ActivationOutcome, Activations
from .admission import (
    ActivePlanBinding,
    AdmissionError,
    AdmissionErrorCode,
    AdmittedPlan,
    RequestBoundView,
    TriggerSelection,
    select_for_trigger,
    select_plan_for_trigger,
)
from .compiling import PlanCompiler
from .errors import ActivationBlockedError, FlowVersionConflictError
from .inputs import DEFAULT_WAIT_PRODUCERS, CatalogSnapshot, build_compiler_inputs
from .inventory import Cohort, DiagnosticValue, InventoryRow, inventory_row
from .policy import DEFAULT_POLICY_DOCUMENT, PolicyGeneration, normalize_policy_document
from .policy_store import PolicyStore
from .service import CompileOutcome, DefinitionService, PlanView
from .source import FlowSourceInfo, FlowSourceInvalidError, parse_source_json

__all__ = [
    "DEFAULT_POLICY_DOCUMENT",
    "DEFAULT_WAIT_PRODUCERS",
    "ActivationBlockedError",
    "ActivationOutcome",
    "Activations",
    "ActivePlanBinding",
    "AdmissionError",
    "AdmissionErrorCode",
    "AdmittedPlan",
    "CatalogSnapshot",
    "Cohort",
    "CompileOutcome",
    "DefinitionService",
    "DiagnosticValue",
    "FlowSourceInfo",
    "FlowSourceInvalidError",
    "FlowVersionConflictError",
    "InventoryRow",
    "PlanCompiler",
    "PlanView",
    "PolicyGeneration",
    "PolicyStore",
    "RequestBoundView",
    "TriggerSelection",
    "build_compiler_inputs",
    "inventory_row",
    "normalize_policy_document",
    "parse_source_json",
    "select_for_trigger",
    "select_plan_for_trigger",
]
