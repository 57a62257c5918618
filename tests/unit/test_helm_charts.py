"""The Helm charts against the code: every FLOW_* variable wired, strict schemas.

``make helm-check`` (part of ``make lint``) lints, renders and validates the charts with
helm and kubernetes-validate; this test needs neither and catches the drift that matters
most: a variable added to ``services/config.py`` that no chart sets. A new variable is
owned by the service its prefix names (``FLOW_RUNTIME_*`` -> runtime …) or, without one,
by all three; wire it into the chart(s) or list it in ``NOT_DEPLOYED`` with the reason.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.config import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / "helm"
CHARTS = ("catalog", "runtime", "effect-owner")

#: Variables no chart sets, and why.
NOT_DEPLOYED = {
    "FLOW_CRASH_AT": "fault hook: refused in production, forbidden by the schemas",
    "FLOW_CRASH_MARKER_FILE": "fault hook bookkeeping for the crash tests",
    "FLOW_CRASH_STEP_ENTRY_FILE": "step-entry counter of the crash tests (refused in production)",
    "FLOW_RUNTIME_VIEW_FILE": "tests/dev only: replaces the catalog's metadata views",
    "FLOW_MAIL_SINK_DIR": "`make run` only: where the dev SMTP sink writes its .eml files",
}
#: Variables whose owner is not the service their prefix names.
OWNERS = {
    "FLOW_CATALOG_TARGET": {"runtime"},  # where the runtime dials the catalog
    "FLOW_EFFECT_OWNER_TARGETS": {"runtime"},  # where the runtime dials the effect owners
}
#: Settings of the transactional outbox: the runtime and the effect owner have one.
OUTBOX_OWNERS = {"runtime", "effect-owner"}
_PREFIX_OWNER = {
    "FLOW_CATALOG_": "catalog",
    "FLOW_RUNTIME_": "runtime",
    "FLOW_EFFECT_": "effect-owner",
}


def owners(name: str) -> set[str]:
    if name in OWNERS:
        return OWNERS[name]
    if name.startswith("FLOW_OUTBOX_"):
        return OUTBOX_OWNERS
    for prefix, chart in _PREFIX_OWNER.items():
        if name.startswith(prefix):
            return {chart}
    return set(CHARTS)


def chart_text(chart: str) -> str:
    """Everything that can set a variable for ``chart``: its templates and values, and
    the shared library's templates."""
    files = [*sorted((HELM / chart / "templates").rglob("*")), HELM / chart / "values.yaml"]
    files += sorted((HELM / "nexus-lib" / "templates").glob("*.tpl"))
    return "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


@pytest.mark.parametrize("chart", CHARTS)
def test_every_variable_the_service_reads_is_wired_into_its_chart(chart: str) -> None:
    text = chart_text(chart)
    expected = {n for n in ENV_VARS if n not in NOT_DEPLOYED and chart in owners(n)}
    missing = sorted(n for n in expected if n not in text)
    assert not missing, (
        f"helm/{chart} does not set {missing}: wire them into the chart (ConfigMap/Secret) "
        "or add them to NOT_DEPLOYED with the reason"
    )


def test_exclusions_and_owner_overrides_name_real_variables() -> None:
    assert set(NOT_DEPLOYED) <= set(ENV_VARS)
    assert set(OWNERS) <= set(ENV_VARS)


def _schema(chart: str) -> dict[str, Any]:
    return json.loads((HELM / chart / "values.schema.json").read_text(encoding="utf-8"))


def _values(chart: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((HELM / chart / "values.yaml").read_text())
    return values


@pytest.mark.parametrize("chart", CHARTS)
def test_default_values_pass_the_strict_schema_and_default_to_production(chart: str) -> None:
    values = _values(chart)
    jsonschema.validate(values, _schema(chart))
    assert values["flowEnv"] == "production"
    assert values["database"]["autoMigrate"] is False  # the hook Job migrates


@pytest.mark.parametrize("chart", CHARTS)
@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"extraEnv": {"FLOW_CRASH_AT": "step_commit_returned"}}, "fault hook"),
        ({"extraEnv": {"FLOW_CRASH_MARKER_FILE": "/tmp/x"}}, "fault hook"),
        ({"extraEnv": {"FLOW_RUNTIME_VIEW_FILE": "/tmp/view.json"}}, "test-only view"),
        ({"replicaCount": 0}, "no pods"),
        ({"flowEnv": "staging"}, "unknown FLOW_ENV"),
        ({"tls": {"enabled": True, "secretNmae": "typo"}}, "misspelt key"),
        ({"image": {"repository": "r", "digest": "latest"}}, "digest that is not one"),
        ({"module": "other_svc"}, "fixed module"),
    ],
)
def test_the_schema_refuses_fault_hooks_and_unknown_keys(
    chart: str, change: dict[str, Any], why: str
) -> None:
    values = copy.deepcopy(_values(chart))
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key].update(value)
        else:
            values[key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, _schema(chart))
    # A harmless extra variable is fine.
    ok = copy.deepcopy(_values(chart))
    ok["extraEnv"] = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    jsonschema.validate(ok, _schema(chart))


def test_the_committed_schemas_are_what_the_generator_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "helm_schema.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_production_example_sets_tls_and_database_secrets_for_every_service() -> None:
    prod = yaml.safe_load(
        (HELM / "nexus-flow" / "ci" / "production-tls-mariadb-values.yaml").read_text()
    )
    for chart in CHARTS:
        block = prod[chart]
        assert block["tls"]["enabled"] and block["tls"]["clientAuth"], chart
        assert block["database"]["existingSecret"], chart
        merged = copy.deepcopy(_values(chart))
        for key, value in block.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        jsonschema.validate(merged, _schema(chart))


def test_the_galera_example_passes_every_schema_and_names_a_database_secret() -> None:
    """``helm/examples/galera-values.yaml`` (docs/scale-out.md §5) stays valid for the
    charts it configures."""
    example = yaml.safe_load((HELM / "examples" / "galera-values.yaml").read_text())
    for chart in CHARTS:
        block = example[chart]
        assert block["database"]["existingSecret"], chart
        merged = copy.deepcopy(_values(chart))
        for key, value in block.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        jsonschema.validate(merged, _schema(chart))


@pytest.mark.parametrize(
    ("value", "valid"),
    [(0, True), (2, True), (64, True), ("auto", True), (-1, False), (65, False), ("4", False)],
)
def test_worker_processes_take_a_count_or_auto(value: Any, valid: bool) -> None:
    """``FLOW_RUNTIME_WORKER_PROCESSES`` (``worker.processes``, ``runtime.workerProcesses``):
    the schema admits what ``services.config.worker_processes`` accepts."""
    for path in (("worker", "processes"), ("runtime", "workerProcesses")):
        values = copy.deepcopy(_values("runtime"))
        values[path[0]][path[1]] = value
        if valid:
            jsonschema.validate(values, _schema("runtime"))
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(values, _schema("runtime"))
