"""No Flow-specific outbox machinery (§10.7, §22.5): the runtime's only outbox table is
the canonical ``runtime_outbox``, its delivery state is written only by the generic
``services.outbox`` store, and ``flow.effect.submit`` is a family registration — not a
table, claimer, state machine or read path of its own."""

from __future__ import annotations

import re
from pathlib import Path

from runtime_svc import schema as runtime_schema
from runtime_svc.outbox import RUNTIME_OUTBOX, flow_effect_submit_family
from services.effect_contract import FLOW_EFFECT_SUBMIT_FAMILY
from services.outbox import MessageFamily
from services.outbox.model import DeliveryState

ROOT = Path(__file__).resolve().parents[3]


def test_the_runtime_has_exactly_one_outbox_table_and_it_is_the_canonical_one() -> None:
    with_delivery_state = [
        t.name for t in runtime_schema.metadata.sorted_tables if "delivery_state" in t.c
    ]
    assert with_delivery_state == ["runtime_outbox"]
    assert RUNTIME_OUTBOX.table is runtime_schema.runtime_outbox


def test_no_runtime_module_writes_outbox_delivery_state_or_defines_its_states() -> None:
    writes = re.compile(r"(update|insert|delete)\(\s*(runtime_outbox|RUNTIME_OUTBOX)\b")
    codes = re.compile(
        "|".join(re.escape(f'"{s.value}"') for s in DeliveryState if s is not DeliveryState.PENDING)
    )
    offenders = []
    for path in sorted((ROOT / "runtime_svc").rglob("*.py")):
        if "migrations" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        if writes.search(text) or codes.search(text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_flow_effect_submit_is_a_family_registration() -> None:
    family = flow_effect_submit_family(
        handoff=_Handoff(),  # type: ignore[arg-type]
        policy=MessageFamily("x", _Handoff().deliver).policy,
    )
    assert family.name == FLOW_EFFECT_SUBMIT_FAMILY
    assert family.reconcile is not None and family.finalizer is None


class _Handoff:
    async def deliver(self, message: object) -> object:
        raise NotImplementedError

    async def reconcile(self, message: object) -> object:
        raise NotImplementedError
