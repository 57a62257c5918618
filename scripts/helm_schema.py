"""Write the strict ``values.schema.json`` of the three service charts from one description.

Usage: ``.venv/bin/python scripts/helm_schema.py`` (``make helm-schema``); ``--check``
exits 1 when a committed schema differs from what this script writes (the unit test
``tests/unit/test_helm_charts.py`` runs the same comparison).

The three charts share almost every key (nexus-lib renders them), so the schemas are built
from one set of definitions plus each service's own block. Every object is closed
(``additionalProperties: false``): a misspelt key fails ``helm install``/``helm lint``
instead of being ignored. Fault-injection settings are refused: ``extraEnv`` may not
name ``FLOW_CRASH_*`` or the test-only ``FLOW_RUNTIME_VIEW_FILE``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHARTS = {
    "catalog": {"port": 50061, "module": "catalog_svc", "var": "CATALOG", "db": "CATALOG"},
    "runtime": {"port": 50062, "module": "runtime_svc", "var": "RUNTIME", "db": "RUNTIME"},
    "effect-owner": {
        "port": 50063,
        "module": "effect_owner_svc",
        "var": "EFFECT",
        "db": "EFFECT",
    },
}
#: extraEnv names the schema refuses: fault hooks and test-only settings.
FORBIDDEN_ENV = r"^FLOW_(CRASH_|RUNTIME_VIEW_FILE$)"


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        out["required"] = required
    return out


STR = {"type": "string"}
BOOL = {"type": "boolean"}
K8S_OBJECT = {"type": "object"}  # passed through to Kubernetes, validated there
K8S_LIST = {"type": "array", "items": {"type": "object"}}


def count(minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum}


def quantity() -> dict[str, Any]:
    return {"type": ["string", "integer", "number"]}


def resources() -> dict[str, Any]:
    q = obj({"cpu": quantity(), "memory": quantity(), "ephemeral-storage": quantity()})
    return obj({"requests": q, "limits": q}, ["requests", "limits"])


def probe() -> dict[str, Any]:
    return obj(
        {
            "initialDelaySeconds": count(),
            "periodSeconds": count(1),
            "timeoutSeconds": count(1),
            "failureThreshold": count(1),
        },
        ["initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold"],
    )


def pdb() -> dict[str, Any]:
    return obj({"enabled": BOOL, "minAvailable": count(), "maxUnavailable": count()})


def autoscaling() -> dict[str, Any]:
    return obj(
        {
            "enabled": BOOL,
            "minReplicas": count(1),
            "maxReplicas": count(1),
            "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1, "maximum": 100},
        }
    )


def common(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "enabled": {"type": "boolean", "description": "set by the umbrella chart"},
        "global": K8S_OBJECT,
        "nexus-lib": K8S_OBJECT,
        "image": obj(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": STR,
                "digest": {"type": "string", "pattern": r"^(sha256:[a-f0-9]{64})?$"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            ["repository"],
        ),
        "imagePullSecrets": K8S_LIST,
        "fullnameOverride": STR,
        "replicaCount": count(1),
        "flowEnv": {
            "enum": ["production", "test", "development"],
            "description": "FLOW_ENV; production refuses fault hooks and development keys",
        },
        "logLevel": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
        "eventLoop": {
            "enum": ["auto", "asyncio", "uvloop"],
            "description": "FLOW_EVENT_LOOP; auto = uvloop when installed (the image has it)",
        },
        "requestRetentionHours": {
            **count(1),
            "description": "FLOW_REQUEST_RETENTION_HOURS; the request_id dedupe window",
        },
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "grpc": obj(
            {"maxMessageBytes": count(1024), "shutdownGraceSeconds": count()},
            ["maxMessageBytes", "shutdownGraceSeconds"],
        ),
        "database": obj(
            {
                "existingSecret": STR,
                "secretKey": {"type": "string", "minLength": 1},
                "url": {
                    "type": "string",
                    "pattern": r"^((sqlite\+aiosqlite|mysql\+asyncmy|mysql\+aiomysql)://.*)?$",
                },
                "poolSize": count(1),
                "autoMigrate": BOOL,
            }
        ),
        "migration": obj(
            {
                "enabled": BOOL,
                "backoffLimit": count(),
                "activeDeadlineSeconds": count(1),
                "resources": resources(),
            }
        ),
        "auth": obj(
            {
                "trustedKeys": obj({"existingSecret": STR, "key": {"type": "string"}}),
                "signingKey": obj(
                    {
                        "existingSecret": STR,
                        "key": {"type": "string"},
                        "keyId": STR,
                        "required": BOOL,
                    }
                ),
                "clockSkewSeconds": count(),
            }
        ),
        "tls": obj(
            {
                "enabled": BOOL,
                "secretName": STR,
                "clientAuth": BOOL,
                "serverName": STR,
                "clientServerName": STR,
            }
        ),
        "otel": obj(
            {
                "enabled": BOOL,
                "exporter": {"enum": ["otlp", "console", "none"]},
                "consoleExport": BOOL,
                "sqlSpans": BOOL,
                "otlp": obj({"endpoint": STR, "protocol": {"enum": ["http/protobuf", "grpc"]}}),
            }
        ),
        "metrics": obj(
            {
                "enabled": BOOL,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "stateIntervalMs": count(),
                "stateOrgs": count(1),
                "countCap": count(1),
                "probeWindow": count(1),
                "podAnnotations": BOOL,
                "podMonitor": obj({"enabled": BOOL, "interval": STR, "labels": K8S_OBJECT}),
                "scrapers": K8S_LIST,
            }
        ),
        "extraEnv": {
            "type": "object",
            "description": "more environment variables; fault hooks are refused",
            "propertyNames": {
                "pattern": r"^[A-Z_][A-Z0-9_]*$",
                "not": {"pattern": FORBIDDEN_ENV},
            },
            "additionalProperties": {"type": ["string", "number", "boolean"]},
        },
        "probes": obj(
            {"startup": probe(), "liveness": probe(), "readiness": probe()},
            ["startup", "liveness", "readiness"],
        ),
        "resources": resources(),
        "podDisruptionBudget": pdb(),
        "autoscaling": autoscaling(),
        "service": obj(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "annotations": K8S_OBJECT,
            }
        ),
        "serviceAccount": obj({"create": BOOL, "name": STR, "annotations": K8S_OBJECT}),
        "networkPolicy": obj(
            {
                "enabled": BOOL,
                "fromComponents": {
                    "type": "array",
                    "items": {"enum": ["catalog", "runtime", "runtime-worker", "effect-owner"]},
                },
                "clients": K8S_LIST,
            }
        ),
        "podAnnotations": K8S_OBJECT,
        "podLabels": K8S_OBJECT,
        "nodeSelector": K8S_OBJECT,
        "tolerations": K8S_LIST,
        "affinity": K8S_OBJECT,
        "topologySpreadConstraints": K8S_LIST,
        "module": {"const": spec["module"]},
        "healthService": {"const": name},
        "portVariable": {"const": f"FLOW_{spec['var']}_PORT"},
        "dbUrlVariable": {"const": f"FLOW_{spec['db']}_DB_URL"},
    }


#: One `kind=host:port` entry of FLOW_EFFECT_OWNER_TARGETS (`*` = any kind).
_TARGET = r"[a-z*][a-z0-9_.*-]*=[^\s:,=]+:\d+"


#: FLOW_RUNTIME_WORKER_PROCESSES: an integer 0..64 or "auto" (services.config).
WORKER_PROCESSES = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 64}, {"const": "auto"}]}


def runtime_only() -> dict[str, Any]:
    worker = obj(
        {
            "enabled": BOOL,
            "replicaCount": count(1),
            "workers": count(1),
            "processes": WORKER_PROCESSES,
            "sweeps": BOOL,
            "resources": resources(),
            "podDisruptionBudget": pdb(),
            "autoscaling": autoscaling(),
        }
    )
    settings = obj(
        {
            "workers": count(),
            "workerProcesses": WORKER_PROCESSES,
            "sweeps": BOOL,
            "leaseMs": count(1),
            "retryBaseMs": count(1),
            "retryMaxMs": count(1),
            "maxAttempts": count(1),
            "idleMs": count(1),
            "sweepMs": count(1),
            "reauthCacheMs": count(),
            "retentionDays": count(1),
            "waitSweepMs": count(1),
            "waitBatch": count(1),
            "signalKinds": {
                "type": "array",
                "items": {"type": "string", "pattern": r"^[a-z][a-z0-9_.-]{0,63}$"},
                "minItems": 1,
            },
            "legacyScheduler": BOOL,
            "preclaimWake": BOOL,
        }
    )
    return {
        "catalogTarget": {"type": "string", "pattern": r"^([^\s:]+:\d+)?$"},
        "effectOwnerTargets": {
            "type": "string",
            "pattern": rf"^({_TARGET}(,{_TARGET})*)?$",
        },
        "outbox": obj(
            {
                "dispatchers": count(),
                "maxAttempts": count(1),
                "reconcileMaxAttempts": count(1),
                "retryBaseMs": count(1),
                "retryMaxMs": count(1),
                "leaseMs": count(100),
                "idleMs": count(1),
                "sweepMs": count(1),
            }
        ),
        "runtime": settings,
        "worker": worker,
    }


def effect_owner_only() -> dict[str, Any]:
    return {
        "runtimeTarget": {"type": "string", "pattern": r"^([^\s:]+:\d+)?$"},
        "effects": obj(
            {
                "dispatchers": count(),
                "providers": {
                    "type": "object",
                    "propertyNames": {"pattern": r"^[a-z][a-z0-9_.-]{0,63}$"},
                    "additionalProperties": {"enum": ["email", "webhook"]},
                },
                "maxAttempts": count(1),
                "reconcileMaxAttempts": count(1),
                "retryBaseMs": count(1),
                "retryMaxMs": count(1),
                "leaseMs": count(100),
                "preclaimCommand": BOOL,
                "idleMs": count(1),
                "receiptMaxAttempts": count(1),
            }
        ),
        "smtp": obj(
            {
                "host": STR,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "from": STR,
                "starttls": BOOL,
                "username": STR,
                "passwordSecret": STR,
                "passwordKey": STR,
                "timeoutSeconds": count(1),
            }
        ),
        "webhook": obj(
            {"url": STR, "statusUrl": STR, "timeoutSeconds": count(1), "idempotent": BOOL}
        ),
        "outbox": obj(
            {
                "dispatchers": count(),
                "maxAttempts": count(1),
                "reconcileMaxAttempts": count(1),
                "retryBaseMs": count(1),
                "retryMaxMs": count(1),
                "leaseMs": count(100),
                "idleMs": count(1),
                "sweepMs": count(1),
            }
        ),
    }


def schema(name: str) -> dict[str, Any]:
    spec = CHARTS[name]
    properties = common(name, spec)
    if name == "runtime":
        properties.update(runtime_only())
    if name == "effect-owner":
        properties.update(effect_owner_only())
    out = obj(properties)
    out = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"{name} chart values (generated by scripts/helm_schema.py)",
        **out,
    }
    return out


def render(name: str) -> str:
    return json.dumps(schema(name), indent=2) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name in CHARTS:
        path = ROOT / "helm" / name / "values.schema.json"
        text = render(name)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale (run `make helm-schema`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
