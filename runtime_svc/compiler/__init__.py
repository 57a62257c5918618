"""The pure Flow plan compiler (§7).

``compile_plan(flow_source, inputs) -> ExecutionPlan`` turns one Flow version
plus its bound inputs (sealed capability catalog generation, immutable metadata
view, runtime policy, subflow sources) into an immutable, digest-identified
execution plan, or raises one :class:`PlanCompileError` carrying every issue.
It never performs I/O and never imports another service or generated code.
"""

from __future__ import annotations

from .compile import compile_plan
from .diagnostics import CompileIssue, Diagnostic, PlanCompileError, Severity
from .evaluate import Evaluator, ExpressionEvalError, evaluate, evaluator
from .explain import explain, to_mermaid
from .expressions import ExpressionError, parse_expression, unparse
from .inputs import (
    CapabilityDescriptor,
    CapabilityEntryView,
    CatalogGenerationRef,
    CompilerInputs,
    MetadataViewInput,
    RuntimePolicy,
    RuntimeWorkBindingRef,
)
from .inventory import InventoryEntry, inventory_entry
from .kinds import EdgeKind, ExecutionProfile, ExpiryPolicy, QueueClass, StepKind
from .language import FlowDef
from .parse import FlowSourceError, load_flow_text
from .plan import COMPILER_VERSION, ExecutionPlan, PlanStep
from .validate import validate_effect_pairs

__all__ = [
    "COMPILER_VERSION",
    "CapabilityDescriptor",
    "CapabilityEntryView",
    "CatalogGenerationRef",
    "CompileIssue",
    "CompilerInputs",
    "Diagnostic",
    "EdgeKind",
    "Evaluator",
    "ExecutionPlan",
    "ExecutionProfile",
    "ExpiryPolicy",
    "ExpressionError",
    "ExpressionEvalError",
    "FlowDef",
    "FlowSourceError",
    "InventoryEntry",
    "MetadataViewInput",
    "PlanCompileError",
    "PlanStep",
    "QueueClass",
    "RuntimePolicy",
    "RuntimeWorkBindingRef",
    "Severity",
    "StepKind",
    "compile_plan",
    "evaluate",
    "evaluator",
    "explain",
    "inventory_entry",
    "load_flow_text",
    "parse_expression",
    "to_mermaid",
    "unparse",
    "validate_effect_pairs",
]
