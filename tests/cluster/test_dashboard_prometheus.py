# Over 400 lines: one live cluster scraped by a real Prometheus, every dashboard query checked against it.
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

Beyond "returns data", the panels' values are checked against what the test sent and what the services
count themselves (their own /metrics, read directly): a panel's expression with its rates read as totals
("counter form": rate(X[w]) -> X) gives, between the scrape before the main load and the scrape after it,
exactly the requests and tokens the load's results carry; its ratios equal the services' own counters';
ratios and shares lie in [0, 1]. Every target drafts a forced length (--draft-tokens), so the SSD panels
never hang on the policy choosing to draft (under CI load it once chose not to: no cache lookups).
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
from prometheus_client.parser import text_string_to_metric_families

from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.common.speculation import method_name
from specpool.engine.method import NO_ESTIMATE

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
              "Prompt and generated tokens per second, by tenant", "Drafter cores busy, by endpoint",
              "Drafter core-seconds per target token")
SSD_DRAFT_TOKENS = 3  # every target's forced draft length: each SSD round drafts this many, whatever the policy
# Panels whose every value is a ratio or a share: in [0, 1].
FRACTION_PANELS = ("Draft busy ratio (busiest endpoint)", "Draft busy ratio, by endpoint",
                   "Draft tokens accepted, share of drafted, by tenant", "SSD speculation cache hit ratio, by model",
                   "SSD bonus-token prediction accuracy, by model", "Shared draft batches, share of all",
                   "Router requests not served, share of all, by model", NEW_PANELS[0], NEW_PANELS[1],
                   "Draft acceptance by position", "Requests within the queue-wait SLO (1 s), share, by tenant")


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

    def series(self, expr: str, at: float | None = None) -> dict[frozenset, float]:
        """An instant query's result: each series' labels -> its value (at `at`, unix seconds; else now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return {frozenset(r["metric"].items()): float(r["value"][1]) for r in self.get("/api/v1/query", **params)["result"]}

    def scalar(self, expr: str, at: float | None = None) -> float:
        """The one value of a query that sums to one series; 0 when it has none yet (no such series)."""
        values = list(self.series(expr, at).values())
        assert len(values) <= 1, (expr, values)
        return values[0] if values else 0.0

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


def send_load(cluster) -> tuple[dict[str, list[str]], dict[str, list]]:
    """Streams of greedy and sampled requests, speculation auto, ssd and none, on both tenants at once.
    -> what each stream saw (the method each request ran, or its error), and each stream's results."""
    from specpool_client import final_result, generate_request
    from specpool_client.v1 import target_pb2_grpc

    seen: dict[str, list[str]] = {}
    results: dict[str, list] = {}

    def worker(name: str, tenant: str, plan: list[dict]) -> None:
        stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel(tenant))
        out, done = seen.setdefault(name, []), results.setdefault(name, [])
        for i, kwargs in enumerate(plan):
            request = generate_request(PROMPTS[i % len(PROMPTS)], max_tokens=40, **kwargs)
            try:
                result = final_result(stub.Generate(request, timeout=120))
                out.append(f"{kwargs}: {method_name(result.completions[0].speculation.method)}")
                done.append(result)
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
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "load did not finish in 4 minutes"
    failed = [line for lines in seen.values() for line in lines if "StatusCode" in line]
    assert not failed, failed
    return seen, results


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


def counter_form(expr: str) -> str:
    """The expression with each rate(X{...}[$__rate_interval]) read as X{...}: the totals it is a rate of."""
    out = re.sub(r"rate\((\w+\{[^}]*\})\[\$__rate_interval\]\)", r"\1", expr)
    assert "rate(" not in out, f"a rate this test cannot read as totals: {expr!r}"
    return out


def scrape(servers, token: str) -> list[tuple[str, dict, float]]:
    """Every sample of the servers' own /metrics, read directly (name, labels, value)."""
    samples = []
    for server in servers:
        req = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        samples += [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
                    for s in family.samples]
    return samples


def direct(samples, name: str, by: tuple[str, ...] = (), **labels: str) -> float | dict[tuple, float]:
    """The sum of one sample's values over the series with `labels`; with `by`, per values of those labels."""
    out: dict[tuple, float] = {}
    for sample, have, value in samples:
        if sample == name and all(have.get(k) == v for k, v in labels.items()):
            key = tuple(have.get(b, "") for b in by)
            out[key] = out.get(key, 0.0) + value
    return out if by else out.get((), 0.0)


# The totals that show Prometheus has caught up with the services: (counter, the servers that count it).
CAUGHT_UP = (("specpool_target_generated_tokens_total", "targets"), ("specpool_target_prompt_tokens_total", "targets"),
             ("specpool_target_requests_total", "targets"), ("specpool_target_drafts_offered_total", "targets"),
             ("specpool_target_decode_tokens_total", "targets"), ("specpool_router_requests_total", "routers"),
             ("specpool_spec_drafted_tokens_total", "endpoints"), ("specpool_spec_ssd_cache_lookups_total", "endpoints"))


def wait_caught_up(prom: Prometheus, groups: dict, token: str, timeout_s: float = 60.0) -> float:
    """Polls until the targets are idle and Prometheus' newest samples equal the services' own totals, and
    then until every member was scraped once more (so a series born in the last scrape has the two samples
    a rate needs). -> the unix time Prometheus' view is complete at. Bounded: AssertionError after timeout_s."""
    end = time.monotonic() + timeout_s
    behind: list = []
    while time.monotonic() < end:
        targets = scrape(groups["targets"], token)
        idle = direct(targets, "specpool_target_running_sequences") + direct(targets, "specpool_target_queued_requests")
        own = {g: targets if g == "targets" else scrape(groups[g], token) for g in ("targets", "routers", "endpoints")}
        behind = [(name, prom.scalar(f'sum({name}{{namespace="{NAMESPACE}"}})'), direct(own[g], name))
                  for name, g in CAUGHT_UP]
        behind = [b for b in behind if b[1] != b[2]]
        if idle == 0 and not behind:
            caught = time.time()
            while time.monotonic() < end:
                if prom.scalar(f'min(timestamp(up{{namespace="{NAMESPACE}"}}))') > caught:
                    return time.time()
                time.sleep(0.2)  # polling Prometheus' next scrape (every 1 s)
            break
        time.sleep(0.2)  # polling: the next scrape is at most 1 s away
    raise AssertionError(f"Prometheus did not catch up with the services in {timeout_s}s: {behind}")


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_live_cluster(tmp_path, monkeypatch):
    from specpool.cluster.config import SMOLLM2_CONFIG, ClusterConfig
    from specpool.cluster.launcher import Cluster

    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert set(NEW_PANELS) <= titles, set(NEW_PANELS) - titles
    assert set(FRACTION_PANELS) <= titles, set(FRACTION_PANELS) - titles
    assert "namespace" in {v["name"] for v in dashboard["templating"]["list"]}
    panels = {p["title"]: {t["refId"]: t["expr"] for t in p.get("targets", [])} for p in dashboard["panels"]}
    binary = installed_prometheus()

    token = secrets.token_urlsafe(24)
    monkeypatch.setenv(METRICS_TOKEN_ENV, token)  # the servers inherit it: /metrics wants it
    started = time.monotonic()
    # Every target drafts SSD_DRAFT_TOKENS a round (--draft-tokens): the SSD stream drafts, and its panels have
    # data, whatever the policy would choose under this machine's load. fp32: cheap verify steps, a short run.
    config = ClusterConfig.load(SMOLLM2_CONFIG).with_free_ports()
    forced = ("--draft-tokens", str(SSD_DRAFT_TOKENS))
    cluster = Cluster.start(replace(config, targets=tuple(replace(t, dtype="fp32", args=(*t.args, *forced))
                                                          for t in config.targets)))
    prom = None
    try:
        servers = cluster.servers()
        groups = {"targets": list(cluster.targets.values()), "routers": cluster.routers,
                  "endpoints": list(cluster.endpoints.values())}
        assert status_without_token(servers[0].metrics_port) == 401
        prom = Prometheus(binary, tmp_path, [s.metrics_port for s in servers], token)
        prom.wait_ready()
        prom.wait_targets_up(len(servers))

        load_start = time.monotonic()
        # Requests that end otherwise than ok first, so those outcomes' series exist; how many tokens a
        # cancelled or expired one made is the target's to know, so the main load's counts start after them.
        odd = odd_requests(cluster)
        assert odd == {"cancelled": "CANCELLED", "expired": "DEADLINE_EXCEEDED",
                       "invalid at the router": "INVALID_ARGUMENT", "invalid at the target": "INVALID_ARGUMENT"}, odd
        before = wait_caught_up(prom, groups, token)
        seen, results = send_load(cluster)
        after = wait_caught_up(prom, groups, token)
        window = f"{math.ceil(time.monotonic() - load_start) + 10}s"
        values = resolve_variables(prom, dashboard)
        assert values["namespace"] == NAMESPACE and values["tenant"] == "(alpha|beta)", values

        empty, checked, outside = [], 0, []
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], values).replace("$__rate_interval", window)
                result = prom.get("/api/v1/query", query=expr, time=f"{after:.3f}")["result"]
                checked += 1
                if not any(math.isfinite(float(r["value"][1])) for r in result):
                    empty.append(f"{panel['title']!r} {target['refId']}: {expr}\n    -> {result}")
                if panel["title"] in FRACTION_PANELS:  # NaN is 0/0, no data to Grafana (a series born at its
                    # final count has rate 0: the router's one invalid request, model "unknown")
                    outside += [(panel["title"], target["refId"], r["metric"], r["value"][1]) for r in result
                                if math.isfinite(float(r["value"][1])) and not 0.0 <= float(r["value"][1]) <= 1.0]
        assert not empty, (f"{len(empty)} of {checked} queries returned no finite value:\n" + "\n".join(empty)
                           + "\nload:\n" + json.dumps(seen, indent=1))
        problems = [f"a ratio or share outside [0, 1]: {o}" for o in outside]

        def totals(title: str, ref: str = "A", at: float = after, by: tuple[str, ...] = ()) -> dict[tuple, float]:
            """The panel's query in counter form at `at`, summed per values of the labels `by`."""
            out: dict[tuple, float] = {}
            for labels, value in prom.series(counter_form(substitute(panels[title][ref], values)), at).items():
                key = tuple(dict(labels).get(b, "") for b in by)
                out[key] = out.get(key, 0.0) + value
            return out

        def sent(title: str, ref: str = "A", by: tuple[str, ...] = ()) -> dict[tuple, float]:
            """What the panel's totals grew by over the main load (between the two complete scrapes)."""
            now, then = totals(title, ref, after, by), totals(title, ref, before, by)
            return {k: v - then.get(k, 0.0) for k, v in now.items() if v - then.get(k, 0.0)}

        def check(what: str, got, want) -> None:  # what: the panel's meaning, and what it is checked against
            if got != want:
                problems.append(f"{what}: {got}, expected {want}")

        # Counts: the requests and tokens the main load's results carry, to the request and the token.
        done = [r for stream in results.values() for r in stream]
        generated = sum(len(c.token_ids) for r in done for c in r.completions)
        check("router requests finished, by outcome, vs the load's", sent("Router requests finished per second, by outcome",
                                                             by=("outcome",)), {("ok",): float(len(done))})
        check("target requests finished, by outcome, vs the load's", sent("Requests finished per second, by tenant and outcome",
                                                             by=("outcome",)), {("ok",): float(len(done))})
        check("tokens generated vs the load's", sent("Tokens generated per second"), {(): float(generated)})
        check("prompt tokens vs the load's", sent("Prompt and generated tokens per second, by tenant"),
              {(): float(sum(r.usage.prompt_tokens for r in done))})
        # The dashboard's rate itself: the whole run's tokens over its window (a rate extrapolates a little).
        rate = prom.scalar(substitute(panels["Tokens generated per second"]["A"], values)
                           .replace("$__rate_interval", window), after)
        whole = totals("Tokens generated per second")[()]
        if not 0.9 * whole <= rate * float(window[:-1]) <= 1.1 * whole:
            problems.append(f"tokens generated per second {rate} x {window} is not the run's {whole} tokens")

        # Ratios: equal to the services' own counters, read directly.
        own = {g: scrape(groups[g], token) for g in groups}
        ratio = totals("Draft tokens accepted, share of drafted, by tenant", by=("tenant",))
        accepted = direct(own["endpoints"], "specpool_spec_accepted_tokens_total", by=("tenant",))
        drafted = direct(own["endpoints"], "specpool_spec_drafted_tokens_total", by=("tenant",))
        check("accepted share of drafted, by tenant, vs the endpoint's own counters", ratio,
              {t: accepted.get(t, 0.0) / n for t, n in drafted.items() if n})
        lookups = direct(own["endpoints"], "specpool_spec_ssd_cache_lookups_total")
        hits = direct(own["endpoints"], "specpool_spec_ssd_cache_hits_total")
        if not lookups > 0:
            problems.append("the SSD stream made no speculation-cache lookups")
        check("SSD cache hit ratio vs the endpoint's own counters",
              sum(totals("SSD speculation cache hit ratio, by model").values()), hits / lookups if lookups else None)
        offered = direct(own["targets"], "specpool_target_drafts_offered_total", by=("position",))
        taken = direct(own["targets"], "specpool_target_drafts_accepted_total", by=("position",))
        check("draft acceptance by position vs the targets' own counters", totals("Draft acceptance by position",
                                                                              by=("position",)),
              {p: taken.get(p, 0.0) / n for p, n in offered.items() if n})
        by_method = ("tenant", "method")
        tokens = direct(own["targets"], "specpool_target_decode_tokens_total", by=by_method)
        seconds = direct(own["targets"], "specpool_target_decode_seconds_total", by=by_method)
        check("decode rate per sequence, by tenant and method, vs the targets' own counters",
              totals(NEW_PANELS[3], by=by_method), {k: n / seconds[k] for k, n in tokens.items() if seconds.get(k)})
        # The ssd and none streams' tokens past the first, as the targets count them by method: with every
        # prediction NO_ESTIMATE, AUTO plans n-gram (a tie goes to it), so only these streams run ssd or none.
        decoded = {m: float(sum(max(len(c.token_ids) - 1, 0) for name, stream in results.items()
                                if name.endswith("/" + m) for r in stream for c in r.completions)) for m in ("ssd", "none")}
        check("targets' own decoded tokens, method ssd and none, vs the ssd and none streams'",
              {m: direct(own["targets"], "specpool_target_decode_tokens_total", method=m) for m in decoded}, decoded)
        # The SSD stream drafted the forced length, not the policy's: the targets have no policy (every predicted
        # speedup on the dashboard is NO_ESTIMATE), every ssd request ran SSD, its rounds reached position N and
        # none beyond. Without --draft-tokens the predictions are the policy's own, and it may draft nothing.
        check("predicted speedups (the forced length: no policy)", {
            v for v in totals("Speedup bought by speculation, by tenant (measured and predicted)", "B",
                              by=("tenant", "method")).values()}, {NO_ESTIMATE})
        ssd_runs = [method_name(c.speculation.method) for name, stream in results.items() if name.endswith("/ssd")
                    for r in stream for c in r.completions]
        check("what the ssd stream's requests ran", ssd_runs, ["ssd"] * len(ssd_runs))
        ssd_positions = {int(p) for (p,), n in direct(own["targets"], "specpool_target_drafts_offered_total",
                                                      by=("position",), method="ssd").items() if n}
        check("the deepest position the ssd stream's drafts reached", max(ssd_positions, default=0), SSD_DRAFT_TOKENS)
        assert not problems, "\n".join(problems) + "\nload:\n" + json.dumps(seen, indent=1)
        print(f"DASHBOARD {checked} queries returned data, their counts and ratios the ones sent; load and rate "
              f"window {window}, whole test {time.monotonic() - started:.0f} s")
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
