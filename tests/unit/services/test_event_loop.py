"""FLOW_EVENT_LOOP: which loop a service process runs on (services.event_loop)."""

from __future__ import annotations

import asyncio

import pytest

from services import event_loop
from services.config import ConfigError, ServiceName, load_config


@pytest.mark.parametrize(
    ("choice", "installed", "expected"),
    [
        ("auto", True, "uvloop"),
        ("auto", False, "asyncio"),
        (" AUTO ", True, "uvloop"),
        ("asyncio", True, "asyncio"),
        ("asyncio", False, "asyncio"),
        ("uvloop", True, "uvloop"),
    ],
)
def test_the_choice_resolves_to_one_loop_on_this_host(
    choice: str, installed: bool, expected: str
) -> None:
    assert event_loop.resolve(choice, uvloop_installed=installed) == expected


def test_uvloop_required_but_missing_is_refused() -> None:
    with pytest.raises(ValueError, match="uvloop package is not installed"):
        event_loop.resolve("uvloop", uvloop_installed=False)


@pytest.mark.parametrize("bad", ["trio", "uv", "uvloop2"])
def test_an_unknown_loop_is_a_configuration_error_naming_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match="FLOW_EVENT_LOOP"):
        load_config(ServiceName.RUNTIME, {"FLOW_EVENT_LOOP": bad})


def test_the_default_is_uvloop_where_it_is_installed() -> None:
    # uvloop is a dependency on this platform (pyproject.toml), so `auto` picks it.
    assert load_config(ServiceName.RUNTIME, {}).event_loop == "uvloop"
    assert load_config(ServiceName.RUNTIME, {"FLOW_EVENT_LOOP": "asyncio"}).event_loop == (
        "asyncio"
    )


@pytest.mark.parametrize(("loop", "module"), [("asyncio", "asyncio"), ("uvloop", "uvloop")])
def test_run_drives_the_coroutine_on_the_named_loop(loop: str, module: str) -> None:
    async def which() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert event_loop.run(which(), loop) == module
