"""A bench section run alone (``python -m bench.<section>``) measures on the loop the
services run on, as ``make bench`` does (``FLOW_EVENT_LOOP``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import uvloop

from bench import on_service_loop
from services.config import ConfigError


@pytest.fixture(autouse=True)
def _default_policy_after() -> Iterator[None]:
    yield
    asyncio.set_event_loop_policy(None)


def test_the_default_runs_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOW_EVENT_LOOP", raising=False)
    assert on_service_loop() == "uvloop"
    assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)


def test_the_standard_loop_when_the_services_are_told_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOW_EVENT_LOOP", "asyncio")
    assert on_service_loop() == "asyncio"
    assert not isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)


def test_an_unknown_loop_is_refused_before_anything_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOW_EVENT_LOOP", "trio")
    with pytest.raises(ConfigError):
        on_service_loop()
