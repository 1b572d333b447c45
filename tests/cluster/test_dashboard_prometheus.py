"""The Grafana dashboard (helm/specpool/dashboards/specpool.json) against a real Prometheus scraping a live
`specpool up` cluster under load: every query of every panel returns data through Prometheus' HTTP API,
and so does every template variable's.

Prometheus is the one on PATH, else Debian's `prometheus` package unpacked into .cache/prometheus/ by
scripts/install_prometheus.py (`make test-deps`, which `make test` runs); without either the test fails,
saying to run it.

The scrape is what the chart's ServiceMonitor does: every member's /metrics over HTTP with the metrics
token as a bearer token (the servers here get $SPECPOOL_METRICS_TOKEN, so an unauthenticated scrape would
fail), every second, each series labelled namespace="specpool-test" as the Prometheus Operator labels them
with the release's namespace.

Grafana's variables, substituted as Grafana would: $namespace and $tenant by the values their own queries
(label_values(...)) return from this Prometheus, several joined as a regex "(a|b)"; $__rate_interval by
the whole run's length, so every event of the load is inside each rate's window.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import secrets
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.common.speculation import method_name

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "helm" / "specpool" / "dashboards" / "specpool.json"
NAMESPACE = "specpool-test"
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences why the sky is blue.",
           "List three uses of a hash map, one per line.",
           "def quicksort(xs):\n    "]
NEW_PANELS = ("Draft pool utilisation: sessions open over capacity, by endpoint",
              "Target batch utilisation: running sequences over max batch, by tenant",
              "Speedup bought by speculation, by tenant (measured and predicted)",
              "Decode rate per sequence, by tenant and method (tokens/s with and without speculation)",
              "Draft acceptance by position", "Drafts verified per second, by position",
              "Queue wait, p50 and p95, by tenant (SLO 1 s)",
              "Requests within the queue-wait SLO (1 s), share, by tenant",
              "Queue depth: requests waiting for a batch slot, by tenant",
              "Prompt and generated tokens per second, by tenant")


def installed_prometheus() -> Path:
    # scripts/ is not a package: loaded from the file, as `python scripts/install_prometheus.py` runs it.
    spec = importlib.util.spec_from_file_location("install_prometheus", REPO / "scripts" / "install_prometheus.py")
    installer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installer)
    binary = installer.find_prometheus()
    if binary is None:
        pytest.fail(f"no Prometheus on PATH or in {installer.CACHE}: {installer.WHAT_TO_INSTALL}", pytrace=False)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping the given /metrics ports every second."""

    def __init__(self, binary: Path, workdir: Path, metrics_ports: list[int], token: str):
        token_file = workdir / "metrics-token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "specpool",
                "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in metrics_ports],
                                    "labels": {"namespace": NAMESPACE}}],
            }],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready in {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def wait_targets_up(self, count: int, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while True:
            targets = self.get("/api/v1/targets")["activeTargets"]
            if len(targets) == count and all(t["health"] == "up" for t in targets):
                return
            if time.monotonic() > end:
                states = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
                raise AssertionError(f"scrape targets not all up: {states}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- load ----------------------------------------------------------------------------------------------


def send_load(cluster) -> dict[str, list[str]]:
    """Streams of greedy and sampled requests, speculation auto, ssd and none, on both tenants at once; a
    cancelled one, an expired one and malformed ones. -> what each stream saw: the method each request ran,
    or its error."""
    from specpool_client import final_result, generate_request
    from specpool_client.v1 import target_pb2_grpc

    seen: dict[str, list[str]] = {}

    def worker(name: str, tenant: str, plan: list[dict]) -> None:
        stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel(tenant))
        out = seen.setdefault(name, [])
        for i, kwargs in enumerate(plan):
            request = generate_request(PROMPTS[i % len(PROMPTS)], max_tokens=40, **kwargs)
            try:
                result = final_result(stub.Generate(request, timeout=120))
                out.append(f"{kwargs}: {method_name(result.completions[0].speculation.method)}")
            except grpc.RpcError as e:
                out.append(f"{kwargs}: {e.code()} {e.details()}")

    greedy, sampled = {}, {"temperature": 0.8, "top_k": 50, "seed": 7}
    plans = {
        "auto": [{"speculation": "auto", **greedy}, {"speculation": "auto", **sampled}] * 2,
        "none": [{"speculation": "none", **greedy}, {"speculation": "none", **sampled}] * 2,
        "ssd": [{"speculation": "ssd", **sampled}, {"speculation": "ssd", **greedy}] * 2,
    }
    threads = [threading.Thread(target=worker, args=(f"{tenant}/{kind}", tenant, plan))
               for tenant in ("alpha", "beta") for kind, plan in plans.items()]
    for t in threads:
        t.start()
    odd = odd_requests(cluster)
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "load did not finish in 4 minutes"
    assert odd == {"cancelled": "CANCELLED", "expired": "DEADLINE_EXCEEDED",
                   "invalid at the router": "INVALID_ARGUMENT", "invalid at the target": "INVALID_ARGUMENT"}, odd
    failed = [line for lines in seen.values() for line in lines if "StatusCode" in line]
    assert not failed, failed
    return seen


def odd_requests(cluster) -> dict[str, str]:
    """Requests that end otherwise than ok, so those outcomes' series exist: cancelled by the client
    mid-stream, expired (deadline), invalid at the router (no tokens asked for) and at the target (a
    token id outside the vocabulary, which only the target knows)."""
    from specpool_client import generate_request
    from specpool_client.v1 import target_pb2_grpc

    stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel("alpha"))
    call = stub.Generate(generate_request(PROMPTS[0], max_tokens=200), timeout=120)
    next(iter(call))  # the first token: it runs
    call.cancel()
    out = {"cancelled": call.code().name}
    long = generate_request(PROMPTS[1], max_tokens=300)
    long.ignore_eos = True  # 300 tokens: more than 1.5 s at any speed this machine has
    for what, request, timeout in (
        ("expired", long, 1.5),
        ("invalid at the router", generate_request(PROMPTS[2], max_tokens=0), 30),
        ("invalid at the target", generate_request(prompt_ids=[1, 2, 10**7], max_tokens=8), 30),
    ):
        try:
            for _ in stub.Generate(request, timeout=timeout):
                pass
            out[what] = "OK"
        except grpc.RpcError as e:
            out[what] = e.code().name
    return out


# -- the dashboard's queries -----------------------------------------------------------------------------


def resolve_variables(prom: Prometheus, dashboard: dict) -> dict[str, str]:
    """$name -> the regex Grafana would substitute with every value of the variable selected: the
    values its label_values(METRIC{...}, LABEL) query finds, in the order the dashboard defines them."""
    values = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
        assert m, f"${var['name']}: {query!r} is not label_values(SELECTOR, LABEL)"
        selector, label = substitute(m.group(1), values), m.group(2)
        found = sorted(prom.get(f"/api/v1/label/{label}/values", **{"match[]": selector}))
        assert found, f"${var['name']}: {query!r} found no values"
        assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", v) for v in found), found  # nothing to regex-escape
        values[var["name"]] = found[0] if len(found) == 1 else "(" + "|".join(found) + ")"
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr.replace("$__rate_interval", ""), f"unresolved variable in {expr!r}"
    return expr


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_live_cluster(tmp_path, monkeypatch):
    from specpool.cluster.config import ClusterConfig
    from specpool.cluster.launcher import Cluster

    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert set(NEW_PANELS) <= titles, set(NEW_PANELS) - titles
    assert "namespace" in {v["name"] for v in dashboard["templating"]["list"]}
    binary = installed_prometheus()

    token = secrets.token_urlsafe(24)
    monkeypatch.setenv(METRICS_TOKEN_ENV, token)  # the servers inherit it: /metrics wants it
    started = time.monotonic()
    # The reference format (fp32): its verify steps cost so little beside a decode step that the targets'
    # policy drafts for every method asked, SSD included, so each speculation panel has data. (In q4 a
    # verify step of 8 drafts costs over twice a decode step on 2 cores, and the policy may rightly
    # draft nothing for a request.)
    config = ClusterConfig.load().with_free_ports()
    cluster = Cluster.start(replace(config, targets=tuple(replace(t, dtype="fp32") for t in config.targets)))
    prom = None
    try:
        servers = cluster.servers()
        assert status_without_token(servers[0].metrics_port) == 401
        prom = Prometheus(binary, tmp_path, [s.metrics_port for s in servers], token)
        prom.wait_ready()
        prom.wait_targets_up(len(servers))

        load_start = time.monotonic()
        seen = send_load(cluster)
        time.sleep(4)  # a few more scrapes: the last counts are in, and each new series has two samples
        window = f"{math.ceil(time.monotonic() - load_start) + 10}s"
        values = resolve_variables(prom, dashboard)
        assert values["namespace"] == NAMESPACE and values["tenant"] == "(alpha|beta)", values

        empty, checked = [], 0
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], values).replace("$__rate_interval", window)
                result = prom.get("/api/v1/query", query=expr)["result"]
                checked += 1
                if not any(math.isfinite(float(r["value"][1])) for r in result):
                    empty.append(f"{panel['title']!r} {target['refId']}: {expr}\n    -> {result}")
        assert not empty, (f"{len(empty)} of {checked} queries returned no finite value:\n" + "\n".join(empty)
                           + "\nload:\n" + json.dumps(seen, indent=1))
        print(f"DASHBOARD {checked} queries returned data; load and rate window {window}, "
              f"whole test {time.monotonic() - started:.0f} s")
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()


def status_without_token(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
