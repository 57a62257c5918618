"""The public surfaces of the durable-wait modules are pinned (STYLE 13), and every
waits module declares ``__all__`` naming only what it defines or re-exports."""

from __future__ import annotations

import importlib
import pkgutil

import runtime_svc.waits as waits

MODULES = (
    "evidence",
    "plans",
    "preclaim",
    "queries",
    "reconciler",
    "record_producer",
    "registry",
    "resolution",
    "runtime",
    "signals",
    "steps",
    "support",
)


def test_package_exports_only_the_pure_contract() -> None:
    assert sorted(waits.__all__) == [
        "DEFAULT_SIGNAL_KINDS",
        "EFFECT_EVIDENCE_FIELDS",
        "EFFECT_OUTCOMES",
        "EVIDENCE_DIGEST_KIND",
        "MAX_EVIDENCE_BYTES",
        "ProducerFamily",
        "ProducerIssue",
        "ProducerRegistry",
        "ProducerSpec",
        "SIGNAL_SUBMIT_ROLE",
        "SignalSubmission",
        "evidence_digest",
        "validate_submission",
    ]


def test_every_module_has_an_all_of_names_it_defines() -> None:
    found = sorted(m.name for m in pkgutil.iter_modules(waits.__path__))
    assert found == sorted(MODULES)
    for name in MODULES:
        module = importlib.import_module(f"runtime_svc.waits.{name}")
        assert module.__all__, name
        for symbol in module.__all__:
            assert hasattr(module, symbol), f"{name}.{symbol}"


def test_kernel_wait_modules_export_their_transitions() -> None:
    store = importlib.import_module("runtime_svc.kernel.store_waits")
    transitions = importlib.import_module("runtime_svc.kernel.transitions_waits")
    assert {"WaitStore", "insert_dependency_txn", "insert_signal_txn"} <= set(store.__all__)
    assert {"decide_resolution", "decide_expiry", "decide_repair", "cancel_dependency"} <= set(
        transitions.__all__
    )
