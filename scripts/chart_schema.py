"""Writes helm/specpool/values.schema.json, the JSON Schema Helm checks every value set against (install,
upgrade, template, lint), from the spec below: the one place the chart's value types live.

    python scripts/chart_schema.py          # (re)write the schema (make chart-schema)
    python scripts/chart_schema.py --check  # exit 1 when the file differs from what the spec gives

Closed objects (additionalProperties: false) catch a misspelt key (targetDefault.maxBatch) that would
otherwise render silently; types and ranges catch `replicas: "two"`. Kubernetes' own structures that the
chart passes through whole (resources' quantities, tolerations, affinity, env, volumes, security
contexts) are only typed: the API server checks them. Rules across values (a drain shorter than its
grace period, tenant weights naming tenants that exist, object names unique after the cut to 63
characters) are the templates' (`specpool.validate`): JSON Schema cannot state them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "helm" / "specpool" / "values.schema.json"


# -- building blocks ------------------------------------------------------------------------------------


def closed(properties: dict, *, required: tuple[str, ...] = (), description: str = "") -> dict:
    """An object with exactly these keys (each optional unless required)."""
    schema: dict = {"type": "object"}
    if description:
        schema["description"] = description
    schema["properties"] = properties
    if required:
        schema["required"] = list(required)
    schema["additionalProperties"] = False
    return schema


def _schema(type_: str, description: str = "", **keywords) -> dict:
    """{"type": type_, ...} with the keywords that are set (not None or "")."""
    schema: dict = {"type": type_}
    schema.update({k: v for k, v in keywords.items() if v is not None and v != ""})
    if description:
        schema["description"] = description
    return schema


def integer(minimum: int | None = None, maximum: int | None = None, description: str = "") -> dict:
    return _schema("integer", description, minimum=minimum, maximum=maximum)


def number(minimum: float | None = None, exclusive_minimum: float | None = None, description: str = "") -> dict:
    return _schema("number", description, minimum=minimum, exclusiveMinimum=exclusive_minimum)


def string(pattern: str = "", description: str = "", min_length: int = 0, max_length: int = 0) -> dict:
    return _schema("string", description, pattern=pattern, minLength=min_length or None, maxLength=max_length or None)


def enum(*values: str, description: str = "") -> dict:
    schema: dict = {"type": "string", "enum": list(values)}
    if description:
        schema["description"] = description
    return schema


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def map_of(values: dict, description: str = "") -> dict:
    schema: dict = {"type": "object", "additionalProperties": values}
    if description:
        schema["description"] = description
    return schema


def array(items: dict, description: str = "") -> dict:
    schema: dict = {"type": "array", "items": items}
    if description:
        schema["description"] = description
    return schema


def kubernetes(kind: str = "object", description: str = "") -> dict:
    """A Kubernetes structure passed through whole: the API server checks its fields."""
    schema: dict = {"type": kind}
    if kind == "array":
        schema["items"] = {"type": "object"}
    if description:
        schema["description"] = description
    return schema


BOOL = {"type": "boolean"}
STRING = {"type": "string"}
STRING_MAP = map_of(STRING)
PORT = integer(1, 65535)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = {"type": ["string", "number"], "pattern": r"^[+-]?[0-9.]+([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"}
SIZE = string(r"^([0-9]+(\.[0-9]+)?([kMGTPE]|[KMGTPE]i)?)?$", "a Kubernetes quantity (2Gi), or empty")
INT_OR_PERCENT = {"anyOf": [integer(0), string(r"^[0-9]+%$")]}
DURATION = string(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
LOG_LEVEL = enum("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "debug", "info", "warning", "error", "critical",
                 description="--log-level")
DEVICE = string(r"^(|cpu|cuda(:[0-9]+)?)$", "--device: cpu, cuda or cuda:N; empty: cuda when the pod sees a GPU")
GPU_RESOURCE = string(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
                      "the device plugin's extended resource, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb")
RUNTIME_CLASS = string(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", "a RuntimeClass (e.g. nvidia), or empty")
SECRET_KEY = closed({"name": STRING, "key": STRING})
RESOURCES = closed({"requests": map_of(QUANTITY), "limits": map_of(QUANTITY), "claims": kubernetes("array")},
                   description="container resources (GPUs are added from gpu / gpuResourceName)")
ENV = array({"type": "object", "required": ["name"], "properties": {"name": STRING}}, "further container env entries")
EXTRA_ARGS = array(string(min_length=1), "further flags of the server, one list item each")
SERVICE = closed({"type": enum("ClusterIP", "NodePort", "LoadBalancer"), "annotations": STRING_MAP})
STRATEGY = closed({
    "type": enum("RollingUpdate", "Recreate"),
    "rollingUpdate": closed({"maxSurge": INT_OR_PERCENT, "maxUnavailable": INT_OR_PERCENT}),
}, description="the Deployment's strategy (rollingUpdate is dropped with Recreate)")
PDB = closed({"enabled": BOOL, "maxUnavailable": INT_OR_PERCENT}, description="a PodDisruptionBudget")
PLACEMENT = {
    "nodeSelector": STRING_MAP,
    "tolerations": kubernetes("array"),
    "affinity": kubernetes(),
}
GPU = {
    "gpu": integer(0, description="GPUs to request and limit (as gpuResourceName)"),
    "gpuResourceName": GPU_RESOURCE,
    "runtimeClassName": RUNTIME_CLASS,
    "shmSize": SIZE,
}
PROBE = closed({"periodSeconds": integer(1), "timeoutSeconds": integer(1), "failureThreshold": integer(1)})


# -- the values ------------------------------------------------------------------------------------------

# Every key of targetDefaults; a targets entry may set any of them, and must set tenant.
TARGET = {
    "replicas": integer(0, description="pods of the tenant (ignored while autoscaling.enabled)"),
    "model": string(description="--model: a GGUF file or Hugging Face directory in the pod; empty: the image's "
                             "SmolLM2-135M-Instruct"),
    "maxBatch": integer(1, description="--max-batch"),
    "maxContext": integer(1, description="--max-context"),
    "maxRequestsPerTenant": integer(0, description="--max-requests-per-tenant: requests one tenant holds at this target "
                                                  "at once (0: no cap)"),
    "dtype": enum("auto", "fp32", "bf16", "q4", description="--dtype"),
    "device": DEVICE,
    "threads": integer(0, description="--threads and OMP_NUM_THREADS (0: unset, all cores)"),
    "layoutCores": integer(0, description="--layout-cores: SSD must beat plain decoding on this many cores "
                                          "(0: unset, the target's threads)"),
    "datastore": nullable(string(description="--datastore; empty: none")),
    "specEndpoint": {"type": "boolean", "description": "draft on the chart's speculation endpoint"},
    "endpointIndex": nullable(integer(0, description="the endpoint instance this tenant drafts on")),
    "port": PORT,
    "metricsPort": PORT,
    "graceS": number(0, description="--grace-s: drain time on SIGTERM (< terminationGracePeriodSeconds)"),
    "terminationGracePeriodSeconds": integer(1),
    **GPU,
    "strategy": STRATEGY,
    "podDisruptionBudget": PDB,
    # A tenant's autoscaling replaces the default's whole: enabled, it must say its bounds.
    "autoscaling": {
        **closed({
            "enabled": BOOL,
            "minReplicas": integer(1),
            "maxReplicas": integer(1),
            "queuedRequestsPerPod": {"anyOf": [number(exclusive_minimum=0), QUANTITY]},
            "metricName": string(min_length=1),
            "behavior": kubernetes(description="autoscaling/v2 HorizontalPodAutoscalerBehavior"),
        }, description="a HorizontalPodAutoscaler on the per-pod queue depth"),
        "if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
        "then": {"required": ["minReplicas", "maxReplicas", "queuedRequestsPerPod"]},
    },
    "logLevel": LOG_LEVEL,
    "extraArgs": EXTRA_ARGS,
    "env": ENV,
    "service": SERVICE,
    "resources": RESOURCES,
    **PLACEMENT,
}

VALUES = closed({
    "global": kubernetes(description="Helm's values shared with subcharts"),
    "image": closed({
        "repository": string(min_length=1, description="the image make image / make image-cuda built and pushed"),
        "tag": string(description="default: the chart's appVersion (+ -cuda for variant cuda)"),
        "variant": enum("", "cuda", description="cuda: the image make image-cuda builds"),
        "pullPolicy": enum("Always", "IfNotPresent", "Never"),
    }),
    "imagePullSecrets": array(closed({"name": STRING}, required=("name",))),
    "serviceAccount": closed({"create": BOOL, "name": STRING, "annotations": STRING_MAP}),
    "nameOverride": string(max_length=63),
    "fullnameOverride": string(max_length=63),
    "podSecurityContext": kubernetes(description="every specpool pod's securityContext"),
    "securityContext": kubernetes(description="every specpool container's securityContext"),
    "security": closed({
        "insecure": BOOL,
        "tls": closed({
            "mode": enum("generate", "certManager", "existingSecrets"),
            "generate": closed({"caDays": integer(1), "certDays": integer(1)}),
            "certManager": closed({
                "issuerRef": closed({"name": STRING, "kind": enum("Issuer", "ClusterIssuer"), "group": STRING}),
                "duration": DURATION,
                "renewBefore": DURATION,
                "privateKey": closed({"algorithm": enum("RSA", "ECDSA", "Ed25519"), "size": integer(1),
                                      "rotationPolicy": enum("Never", "Always"), "encoding": enum("PKCS1", "PKCS8")}),
                "spiffeUris": BOOL,
            }),
            "existingSecrets": closed({
                "router": STRING,
                "endpoint": {"anyOf": [STRING, array(STRING)],
                             "description": "a Secret, or one per specEndpoint instance"},
                "targets": map_of(STRING, "tenant -> Secret"),
            }),
            "routerDnsNames": array(STRING),
        }),
        "tokens": closed({
            "existingSecret": SECRET_KEY,
            "tenants": map_of({"anyOf": [STRING, array(STRING)]}, "tenant -> token(s); empty: generated"),
        }),
        "metricsToken": closed({"existingSecret": SECRET_KEY}),
    }),
    "clusterDomain": string(min_length=1),
    "networkPolicy": closed({
        "enabled": BOOL,
        "clientSelector": {"type": ["array", "object"], "description": "NetworkPolicy peers (or one peer)"},
        "metricsFrom": {"type": ["array", "object"], "description": "NetworkPolicy peers (or one peer)"},
        "ephemeralPorts": closed({"from": PORT, "to": PORT}, required=("from", "to")),
    }),
    "podAnnotations": STRING_MAP,
    "podLabels": STRING_MAP,
    "metrics": closed({"podAnnotations": BOOL, "open": BOOL, "requireToken": BOOL}),
    "serviceMonitor": closed({"enabled": BOOL, "interval": DURATION, "scrapeTimeout": DURATION, "labels": STRING_MAP}),
    "dashboard": closed({"enabled": BOOL, "labels": STRING_MAP, "annotations": STRING_MAP}),
    "probes": closed({"startup": PROBE, "liveness": PROBE, "readiness": PROBE}),
    "stepCostCache": closed({"existingClaim": STRING}),
    "models": closed({
        "source": enum("", "pvc", "hostPath", "image", description="where model files come from (\"\": the image's own)"),
        "mountPath": string("^/", min_length=1),
        "pvc": closed({"claimName": STRING, "subPath": STRING}),
        "hostPath": closed({"path": string("^(/.*)?$"),
                            "type": enum("Directory", "DirectoryOrCreate", description="hostPath type")}),
        "image": closed({"repository": STRING, "tag": STRING, "pullPolicy": enum("Always", "IfNotPresent", "Never"),
                         "path": string("^/", min_length=1), "sizeLimit": SIZE, "resources": RESOURCES}),
    }),
    "extraVolumes": array({"type": "object", "required": ["name"]}),
    "extraVolumeMounts": array({"type": "object", "required": ["name", "mountPath"]}),
    "redis": closed({
        "auth": closed({"existingSecret": SECRET_KEY}),
        "external": closed({"urlSecret": SECRET_KEY, "url": string(r"^(rediss?://.+)?$")}),
        "image": closed({"repository": string(min_length=1), "tag": string(min_length=1),
                         "pullPolicy": enum("Always", "IfNotPresent", "Never")}),
        "port": PORT,
        "podSecurityContext": kubernetes(),
        "securityContext": kubernetes(),
        "resources": RESOURCES,
        **PLACEMENT,
        # Gone in chart 0.2: allowed here so that the templates can say where they went.
        "url": {"description": "removed: redis.external.url"},
        "existingSecret": {"description": "removed: redis.external.urlSecret"},
    }),
    "router": closed({
        "replicas": integer(0),
        "port": PORT,
        "metricsPort": PORT,
        "httpPort": integer(0, 65535, description="--http-port: the OpenAI-compatible HTTP front (0: none)"),
        "tenantWeights": map_of(number(exclusive_minimum=0), "--tenant-weights: tenant -> weight > 0"),
        "graceS": number(0, description="--grace-s: drain time on SIGTERM (< terminationGracePeriodSeconds)"),
        "terminationGracePeriodSeconds": integer(1),
        "strategy": STRATEGY,
        "podDisruptionBudget": PDB,
        "logLevel": LOG_LEVEL,
        "extraArgs": EXTRA_ARGS,
        "env": ENV,
        "service": SERVICE,
        "resources": RESOURCES,
        **PLACEMENT,
    }),
    "specEndpoint": closed({
        "enabled": BOOL,
        "replicas": integer(1, description="endpoint instances, each its own Deployment, Service and id"),
        "name": string(DNS_LABEL, "--endpoint-id of instance 0 (instance i: <name>-<i>)", max_length=63),
        "port": PORT,
        "metricsPort": PORT,
        "channelPort": PORT,
        "drafters": array(string(r"^([^=,]+=)?[^=,]+(,(draft|head|datastore)=[^,]+)*$"),
                          "--drafter NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]"),
        "maxSessions": integer(1, description="--max-sessions"),
        "threads": integer(0),
        "device": DEVICE,
        **GPU,
        "terminationGracePeriodSeconds": integer(1),
        "strategy": STRATEGY,
        "podDisruptionBudget": PDB,
        "logLevel": LOG_LEVEL,
        "extraArgs": EXTRA_ARGS,
        "env": ENV,
        "service": SERVICE,
        "resources": RESOURCES,
        **PLACEMENT,
    }),
    "targets": array(closed({"tenant": string(DNS_LABEL, "a DNS label: it names the Deployment", max_length=63),
                             **TARGET}, required=("tenant",)),
                     "the target tenants; any key of targetDefaults may be set per entry"),
    "targetDefaults": closed(TARGET),
    "tests": closed({
        "enabled": BOOL,
        "model": STRING,
        "maxTokens": integer(1),
        "timeoutS": number(exclusive_minimum=0),
        "resources": RESOURCES,
    }, description="helm test: one Generate request through the router"),
})


def schema() -> dict:
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "specpool chart values", **VALUES}


def render() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the schema file is not what the spec gives")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not SCHEMA_PATH.exists() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale: run python scripts/chart_schema.py (make chart-schema)", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
