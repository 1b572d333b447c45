"""The Helm chart (helm/specpool) against the code it deploys, without helm: its values parse, every
metric the Grafana dashboard queries is one the services define, and every flag the templates pass to
a `specpool serve-*` command is one that command accepts."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from router.metrics import RouterMetrics
from spec_endpoint.metrics import EndpointMetrics
from target_service.metrics import TargetMetrics

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specpool"
TEMPLATES = CHART / "templates"
DASHBOARD = CHART / "dashboards" / "specpool.json"
SERVERS = ("serve-target", "serve-spec", "serve-router")
# A flag in a template: `--name` not preceded by a word character or another dash.
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
METRIC = re.compile(r"\bspecpool_[a-zA-Z0-9_]+")
# The sample names prometheus_client exposes for one metric family, by type.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def server_parsers() -> dict[str, argparse.ArgumentParser]:
    from specpool.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub.choices[name] for name in SERVERS}


def defined_metric_samples() -> dict[str, str]:
    """Every sample name the services' registries can expose -> its family's type, from the metric
    classes themselves (so a renamed or removed metric drops out here)."""
    registries = [TargetMetrics("model", "tenant").registry, EndpointMetrics().registry, RouterMetrics().registry]
    samples: dict[str, str] = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in SUFFIXES[family.type]:
                samples[family.name + suffix] = family.type
    return samples


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, and the template variables' queries."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"${var['name']}", query))
    return out


# -- (1) the chart's YAML ---------------------------------------------------------------------------


def test_chart_yaml():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "specpool"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in pyproject, "appVersion should be the project's version"


def test_values_yaml(values):
    for block in ("image", "redis", "router", "specEndpoint", "targets", "targetDefaults", "dashboard",
                  "serviceMonitor", "metrics", "probes"):
        assert block in values, block
    assert values["serviceMonitor"]["enabled"] is False, "the ServiceMonitor is opt-in"
    assert values["dashboard"]["labels"] == {"grafana_dashboard": "1"}
    tenants = [t["tenant"] for t in values["targets"]]
    assert tenants and len(set(tenants)) == len(tenants)
    for tenant in tenants:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", tenant), tenant
    assert set(values["router"]["tenantWeights"]) <= set(tenants)
    for block in (values["router"], values["targetDefaults"]):
        assert block["terminationGracePeriodSeconds"] > block["graceS"], "the pod must outlive its drain"
    # The endpoint drains for serve_until_signal's default grace (10 s): it has no --grace-s.
    assert values["specEndpoint"]["terminationGracePeriodSeconds"] > 10
    ports = [values["router"]["port"], values["router"]["metricsPort"], values["specEndpoint"]["port"],
             values["specEndpoint"]["metricsPort"], values["targetDefaults"]["port"],
             values["targetDefaults"]["metricsPort"]]
    assert len(set(ports)) == len(ports)


def test_templates_present_and_dashboard_shipped():
    names = {p.name for p in TEMPLATES.iterdir()}
    for expected in ("router.yaml", "spec-endpoint.yaml", "targets.yaml", "redis.yaml", "servicemonitor.yaml",
                     "dashboard-configmap.yaml", "_helpers.tpl"):
        assert expected in names, expected
    configmap = (TEMPLATES / "dashboard-configmap.yaml").read_text()
    assert '.Files.Get "dashboards/specpool.json"' in configmap
    for path in TEMPLATES.glob("*"):
        text = path.read_text()
        assert text.count("{{") == text.count("}}"), f"{path.name}: unbalanced template braces"


# -- (2) the dashboard queries metrics that exist -----------------------------------------------------


def test_dashboard_metrics_exist_in_code(dashboard):
    samples = defined_metric_samples()
    exprs = dashboard_exprs(dashboard)
    assert exprs
    used = set()
    for title, expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"{title!r}: {expr!r} queries no specpool_ metric"
        for name in names:
            assert name in samples, f"{title!r} queries {name}, which no specpool metrics class defines"
            used.add(name)
    # The panels the brief names: each of these families is read by some panel.
    for family in ("specpool_target_generated_tokens_total", "specpool_target_time_to_first_token_seconds_bucket",
                   "specpool_target_time_per_output_token_seconds_bucket", "specpool_target_accept_length_sum",
                   "specpool_spec_ssd_cache_hit_ratio", "specpool_spec_draft_busy_ratio",
                   "specpool_spec_shared_batches_total", "specpool_target_spec_fallback_rounds_total",
                   "specpool_router_decisions_total", "specpool_target_running_sequences",
                   "specpool_target_queued_requests", "specpool_router_draft_leases_held"):
        assert family in used, f"no panel reads {family}"


def test_dashboard_queries_use_metric_types_right(dashboard):
    samples = defined_metric_samples()
    for title, expr in dashboard_exprs(dashboard):
        # rate()/increase() only of counters and histogram series, never of a gauge.
        for name in re.findall(r"\b(?:rate|increase)\(\s*(specpool_\w+)", expr):
            assert samples[name] in ("counter", "histogram") and not name.endswith("_created"), (title, name)
        # histogram_quantile over _bucket series, summed by le.
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\b", expr) and re.search(r"by \([^)]*\ble\b", expr), (title, expr)
        for name in METRIC.findall(expr):
            if samples[name] == "histogram":
                assert name.endswith(("_bucket", "_sum", "_count")), (title, name)


def test_dashboard_units(dashboard):
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        defaults = panel["fieldConfig"]["defaults"]
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if "histogram_quantile" in exprs and re.search(r"_seconds_bucket", exprs):
            assert defaults["unit"] == "s", panel["title"]
        if defaults["unit"] == "percentunit":  # ratios: 0-1, shown as percent
            assert defaults.get("min") == 0 and defaults.get("max") == 1, panel["title"]
        if re.search(r"_ratio\b", exprs):
            assert defaults["unit"] == "percentunit", panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# -- (3) the templates pass only flags the servers accept ---------------------------------------------


def template_flags() -> dict[str, set[str]]:
    """serve-* command -> the --flags its template passes (each server lives in its own template)."""
    found: dict[str, set[str]] = {}
    for path in TEMPLATES.glob("*.yaml"):
        text = path.read_text()
        commands = set(re.findall(r"^\s*-\s*(serve-[a-z]+)\s*$", text, re.MULTILINE))
        flags = set(FLAG.findall(text))
        if not commands:
            continue
        assert len(commands) == 1, f"{path.name} runs {commands}: keep one server per template"
        [command] = commands
        found.setdefault(command, set()).update(flags)
    return found


def test_template_flags_exist(server_parsers):
    found = template_flags()
    assert set(found) == set(SERVERS), found
    for command, flags in found.items():
        accepted = set(server_parsers[command]._option_string_actions)
        unknown = flags - accepted
        assert not unknown, f"templates pass {sorted(unknown)} to `specpool {command}`, which does not accept them"
        # --host too: the servers listen on loopback unless told otherwise, and pods are reached on their IP.
        assert {"--port", "--metrics-port", "--redis", "--host"} <= flags, command


def test_values_extra_args_flags_exist(values, server_parsers):
    blocks = {"serve-router": [values["router"]], "serve-spec": [values["specEndpoint"]],
              "serve-target": [values["targetDefaults"], *values["targets"]]}
    for command, entries in blocks.items():
        accepted = set(server_parsers[command]._option_string_actions)
        for entry in entries:
            for arg in entry.get("extraArgs", []):
                flag = arg.split("=", 1)[0]
                if flag.startswith("--"):
                    assert flag in accepted, (command, arg)


def test_server_parsers_take_the_default_values(values, server_parsers):
    """The values the templates pass by default parse (choices and types included)."""
    from router.server import parse_tenant_weights
    from spec_endpoint.registry import DrafterSpec

    r, e, t = values["router"], values["specEndpoint"], values["targetDefaults"]
    weights = ",".join(f"{k}={v}" for k, v in r["tenantWeights"].items())
    assert parse_tenant_weights(weights) == {k: float(v) for k, v in r["tenantWeights"].items()}
    for drafter in e["drafters"]:
        DrafterSpec.parse(drafter)
    server_parsers["serve-router"].parse_args([
        f"--port={r['port']}", f"--metrics-port={r['metricsPort']}", "--redis=redis://x:6379/0",
        f"--tenant-weights={weights}", f"--grace-s={r['graceS']}", f"--log-level={r['logLevel']}"])
    server_parsers["serve-spec"].parse_args([
        f"--port={e['port']}", f"--metrics-port={e['metricsPort']}", "--redis=redis://x:6379/0",
        f"--endpoint-id={e['name']}", "--advertise-host=specpool-spec", "--channel-host=10.0.0.1",
        f"--max-sessions={e['maxSessions']}", f"--threads={e['threads']}", f"--log-level={e['logLevel']}"])
    server_parsers["serve-target"].parse_args([
        f"--port={t['port']}", f"--metrics-port={t['metricsPort']}", "--redis=redis://x:6379/0",
        "--advertise-host=10.0.0.2", "--tenant=alpha", f"--max-batch={t['maxBatch']}",
        f"--max-context={t['maxContext']}", f"--dtype={t['dtype']}", f"--threads={t['threads']}",
        f"--spec-endpoint=specpool-spec:{e['port']}", f"--grace-s={t['graceS']}", f"--log-level={t['logLevel']}"])


# -- the image -----------------------------------------------------------------------------------------


def test_dockerfile_installs_what_the_makefile_does():
    dockerfile = (REPO / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"torch=={torch_pin}" in dockerfile
    for bare in re.findall(r"--no-deps ([^\n]+)", makefile)[0].split():
        assert bare in dockerfile, bare
    assert 'ENTRYPOINT ["specpool"]' in dockerfile
