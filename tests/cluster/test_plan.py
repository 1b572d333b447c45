"""`specpool plan`: the draft-pool sizing model on numbers small enough to check by hand."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import prometheus_client
import pytest

from specpool.cli import main
from specpool.cluster.drafter_capacity import describe_loads, loads_from_bench
from specpool.cluster.plan_inputs import load_demand, stats_from_bench, stats_from_capacity
from specpool.cluster.plan_model import make_plan
from specpool.cluster.plan_report import write_svg
from specpool.common.metrics_http import METRICS_TOKEN_ENV, MetricsHttpServer

# One model, 2 req/s x 200 output tokens = 400 tokens/s of demand, utilization 1, no prompts.
# One replica at batch 4: 100 tokens/s AR, 2.0x with a draft slot. An endpoint holds 4 sessions.
# Costs: a target 1, an endpoint 0.5. A full replica holds 4 sequences, so with R replicas and n
# endpoints f = min(1, 4n / 4R) and R replicas make 100 (R + min(R, n)) tokens/s.
#   n=0: f=0, speedup 1, R = 400/100 = 4                     cost 4
#   n=1: R=3 makes 100 (3+1) = 400 (R=2: 300, too few); f = 4/12 = 1/3, speedup 1 + 1/3 = 1.33
#                                                            cost 3 + 0.5 = 3.5
#   n=2: R=2 makes 100 (2+2) = 400 (R=1: 200); f = 8/8 = 1, speedup 2     cost 2 + 1 = 3  <- best
#   n=3: R=2 still (R=1 makes 200); f = 1, speedup 2          cost 2 + 1.5 = 3.5
# Every sequence is drafted from n=2 on, so the scan stops one endpoint later, at n=3.
DEMAND = """
models:
  tiny:
    requests_per_s: 2
    mean_output_tokens: 200
    tokens_per_s_ar: 100
    speedup: 2.0
    batch_size: 4
costs: {target: 1, endpoint: 0.5}
endpoint_sessions: 4
utilization: 1.0
"""


@pytest.fixture
def demand_file(tmp_path):
    path = tmp_path / "demand.yaml"
    path.write_text(DEMAND)
    return path


def test_hand_computed_plan(demand_file):
    plan = make_plan(load_demand(demand_file))
    table = [(r.endpoints, r.replicas["tiny"], round(r.slot_fraction, 3), round(r.mean_speedup, 3), r.cost)
             for r in plan.rows]
    assert table == [
        (0, 4, 0.0, 1.0, 4.0),
        (1, 3, 0.333, 1.333, 3.5),
        (2, 2, 1.0, 2.0, 3.0),
        (3, 2, 1.0, 2.0, 3.5),
    ]
    assert plan.best.endpoints == 2


def test_prompt_tokens_and_utilization_add_replicas(tmp_path):
    # 2 req/s x (200/1 + 0.5 x 100 prompt tokens) = 500 AR tokens/s at n=0; at utilization 0.5 a replica
    # counts for 50 tokens/s: 10 replicas.
    path = tmp_path / "demand.yaml"
    path.write_text(DEMAND.replace("batch_size: 4", "batch_size: 4\n    prompt_tokens: 100")
                    .replace("utilization: 1.0", "utilization: 0.5\nprefill_token_cost: 0.5"))
    assert make_plan(load_demand(path), max_endpoints=0).rows[0].replicas == {"tiny": 10}


def test_stats_from_bench_takes_largest_batch_draft_model_mode_and_ngram_fallback():
    report = {"model": "m.gguf", "results": [
        {"mode": "ar", "batch_size": 1, "tokens_per_s": 10.0, "speedup_vs_ar": 1.0},
        {"mode": "ar", "batch_size": 8, "tokens_per_s": 40.0, "speedup_vs_ar": 1.0},
        {"mode": "sd", "batch_size": 8, "tokens_per_s": 60.0, "speedup_vs_ar": 1.5},
        {"mode": "ngram", "batch_size": 8, "tokens_per_s": 48.0, "speedup_vs_ar": 1.2},
        {"mode": "hf-ar", "batch_size": 8, "tokens_per_s": 99.0, "speedup_vs_ar": 9.0},
    ]}
    stats = stats_from_bench([report])["m"]
    assert (stats.batch_size, stats.tokens_per_s_ar, stats.speedup, stats.mode) == (8, 40.0, 1.5, "sd")
    assert (stats.fallback_speedup, stats.fallback_mode) == (1.2, "ngram")  # n-gram drafting needs no slot
    assert stats_from_bench([report], fallback_mode="ar")["m"].fallback_speedup == 1.0
    assert stats_from_bench([report], batch_size=1)["m"].speedup == 1.0  # nothing but AR measured at batch 1


def test_speculation_slower_than_fallback_recommends_no_endpoints(demand_file, tmp_path):
    path = tmp_path / "slow.yaml"
    path.write_text(demand_file.read_text().replace("speedup: 2.0", "speedup: 0.9"))
    plan = make_plan(load_demand(path))
    assert plan.best.endpoints == 0 and plan.notes


def test_cli_writes_a_valid_svg(demand_file, tmp_path, capsys):
    out = tmp_path / "plan.svg"
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"model": "tiny.gguf", "results": [
        {"mode": "ar", "batch_size": 4, "tokens_per_s": 100.0, "speedup_vs_ar": 1.0},
        {"mode": "sd", "batch_size": 4, "tokens_per_s": 200.0, "speedup_vs_ar": 2.0},
    ]}))
    plain = tmp_path / "plain.yaml"
    plain.write_text("models:\n  tiny: {requests_per_s: 2, mean_output_tokens: 200}\n"
                     "costs: {endpoint: 0.5}\nendpoint_sessions: 4\nutilization: 1\n")
    assert main(["plan", "--demand", str(plain), "--stats", str(bench), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recommendation: 2 speculation endpoint(s) and 2 x tiny" in printed
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2  # speedup and cost


def test_write_svg_with_a_single_row(demand_file, tmp_path):
    """One row (n=0: speedup 1.0, cost 4): the x axis still spans 0..1 and the speedup axis, all one
    value, is widened to 1.00x..2.05x, so each line is one point on the plot's left edge (x = 70) at
    its value: speedup 1.0 at the bottom (y = 340), cost 4 of an axis 0..4.2 at y = 40 + 300 (1 - 4/4.2)."""
    plan = make_plan(load_demand(demand_file), max_endpoints=0)
    assert [(r.endpoints, r.mean_speedup, r.cost) for r in plan.rows] == [(0, 1.0, 4.0)]
    out = tmp_path / "one.svg"
    write_svg(plan, out)
    svg = "{http://www.w3.org/2000/svg}"
    root = ET.parse(out).getroot()
    assert root.tag == f"{svg}svg"
    assert [(p.get("stroke"), p.get("points")) for p in root.iter(f"{svg}polyline")] == [
        ("#1f77b4", "70.0,340.0"), ("#d62728", "70.0,54.3")]  # speedup, cost
    assert [(c.get("cx"), c.get("cy")) for c in root.iter(f"{svg}circle")] == [("70.0", "340.0"), ("70.0", "54.3")]
    texts = list(root.iter(f"{svg}text"))

    def ticks(**attrs) -> list[str]:
        return [t.text for t in texts if "transform" not in t.attrib and all(t.get(k) == v for k, v in attrs.items())]

    assert ticks(fill="#1f77b4") == ["1.00x", "1.26x", "1.52x", "1.79x", "2.05x"]  # speedup, bottom up
    assert ticks(fill="#d62728") == ["0", "1.05", "2.1", "3.15", "4.2"]  # cost
    assert ticks(y="358") == ["0", "1"]  # endpoints, under the plot
    assert ticks(fill="#2ca02c") == ["recommended: 0 (cost 4)"]
    assert "nan" not in out.read_text().lower() and "inf" not in out.read_text().lower()


def test_live_capacity_gives_sessions_and_predicted_speedup(tmp_path, capsys):
    # A router's /capacity (protobuf JSON): endpoints of 4 sessions, targets at batch 4 predicting 2.0x with
    # the draft model and 0.9x with n-gram drafting (so a sequence without a slot runs AR).
    # AR throughput is not in it, so the demand file carries it: the hand-computed case again.
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({
        "pools": [{"model": "tiny", "predictedSpeedupDraft": 2.0, "predictedSpeedupNgram": 0.9,
                   "targets": [{"maxBatch": 4}, {"maxBatch": 4}]}],
        "endpoints": [{"id": "spec", "maxSessions": 4}],
    }))
    demand = tmp_path / "demand.yaml"
    demand.write_text("models:\n  tiny: {requests_per_s: 2, mean_output_tokens: 200, tokens_per_s_ar: 100}\n"
                      "costs: {endpoint: 0.5}\nutilization: 1\n")
    assert main(["plan", "--demand", str(demand), "--capacity-url", capacity.as_uri()]) == 0
    assert "recommendation: 2 speculation endpoint(s) and 2 x tiny (cost 3" in capsys.readouterr().out
    demand.write_text("models:\n  tiny: {requests_per_s: 2, mean_output_tokens: 200}\n")
    assert main(["plan", "--demand", str(demand), "--capacity-url", capacity.as_uri()]) == 2  # no AR throughput


def test_a_live_slot_is_worth_the_faster_of_the_draft_model_and_ssd():
    """The router plans SSD where the targets predict it beats the draft model (on all its layout's
    cores): a slot is then worth SSD's figure. A router from before that figure gives none."""
    pool = {"model": "tiny", "predictedSpeedupDraft": 1.2, "predictedSpeedupNgram": 0.9, "targets": [{"maxBatch": 4}]}
    [ssd] = stats_from_capacity({"pools": [pool | {"predictedSpeedupSsd": 1.5}]}).values()
    assert ssd.speedup == 1.5 and ssd.mode == "ssd, predicted by the targets" and ssd.fallback_mode == "ar"
    for older in (pool, pool | {"predictedSpeedupSsd": 0.7}):
        [draft] = stats_from_capacity({"pools": [older]}).values()
        assert draft.speedup == 1.2 and draft.mode == "draft model, predicted by the targets"


def test_live_capacity_behind_the_metrics_token_is_read_with_it(tmp_path, monkeypatch, capsys):
    """An operator's tool: a server started with a metrics token answers plan only with that token
    ($SPECPOOL_METRICS_TOKEN), and without it plan says which variable to set."""
    report = {"pools": [{"model": "tiny", "predictedSpeedupDraft": 2.0, "targets": [{"maxBatch": 4}]}],
              "endpoints": [{"id": "spec", "maxSessions": 4}]}
    http = MetricsHttpServer(prometheus_client.CollectorRegistry(), 0, host="127.0.0.1",
                             json_routes={"/capacity": lambda operator: report}, token="operators-token-1234")
    http.start()
    try:
        demand = tmp_path / "demand.yaml"
        demand.write_text("models:\n  tiny: {requests_per_s: 2, mean_output_tokens: 200, tokens_per_s_ar: 100}\n")
        plan = ["plan", "--demand", str(demand), "--capacity-url", f"http://127.0.0.1:{http.port}/capacity"]
        monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)
        assert main(plan) == 2 and f"set {METRICS_TOKEN_ENV}" in capsys.readouterr().err
        monkeypatch.setenv(METRICS_TOKEN_ENV, "a-tenants-guess")
        assert main(plan) == 2 and "was refused" in capsys.readouterr().err
        monkeypatch.setenv(METRICS_TOKEN_ENV, "operators-token-1234")
        assert main(plan) == 0 and "endpoint capacity: 4 sessions" in capsys.readouterr().out
    finally:
        http.stop()


# Drafter capacity by hand: alone, a target decodes AR at 20 tokens/s and 1.5x through the endpoint (30 tokens/s),
# each of its tokens costing the endpoint 20 core-ms of drafting: it keeps 30 x 0.02 = 0.6 drafter cores busy. One
# drafter core serves 1/0.6 = 1.67 such targets at full speed and 1/(20 x 0.02) = 2.5 before each falls to AR's
# speed. The endpoint had 1 thread, so with 2 targets each is predicted 1.5 x 1.67/2 = 1.25x; the two measured
# 1.2x and 1.3x (1.25x: 0% off) sharing forwards, at 15 core-ms a token.
DRAFTER_BENCH = {"model": "pair.gguf", "results": [
    {"mode": "ar", "batch_size": 1, "tokens_per_s": 20.0, "speedup_vs_ar": 1.0},
    {"mode": "sd-remote", "batch_size": 1, "tokens_per_s": 30.0, "speedup_vs_ar": 1.5, "mean_accept_len": 3.0,
     "drafter_core_s_per_token": 0.02, "drafter_cores_busy": 0.6, "drafter_threads": 1, "predicted_speedup": 1.35},
    {"mode": "sd-remote-x2", "batch_size": 1, "tokens_per_s": 50.0, "speedup_vs_ar": 1.25, "mean_accept_len": 3.0,
     "drafter_core_s_per_token": 0.015, "drafter_cores_busy": 0.75, "drafter_threads": 1, "predicted_speedup": 1.0,
     "targets": [{"tokens_per_s": 24.0, "speedup_vs_ar": 1.2}, {"tokens_per_s": 26.0, "speedup_vs_ar": 1.3}]},
]}


def test_drafter_capacity_by_hand():
    one, two = loads_from_bench(DRAFTER_BENCH)
    assert (one.mode, one.targets, two.mode, two.targets) == ("sd-remote", 1, "sd-remote-x2", 2)
    assert one.cores_per_target == pytest.approx(0.6)
    assert one.full_speed_targets == pytest.approx(1 / 0.6) and one.paying_targets == pytest.approx(2.5)
    assert one.speedup_with(1, 1) == 1.5 and one.speedup_with(2, 1) == pytest.approx(1.25)
    assert two.speedup == pytest.approx(1.25) and two.tokens_per_s_ar == pytest.approx(20.0)
    text = describe_loads([one, two])
    assert "1.50x measured each, 1.35x predicted by the targets' policies (10% off, within 15%)" in text
    assert "1.25x measured each, 1.00x predicted by the targets' policies (20% off, OUTSIDE 15%)" in text
    assert "one drafter core: 1.67 targets at full speed, pays up to 2.50 targets" in text
    assert "predicted from sd-remote alone on 1 drafter cores: 1.25x each (0% off, within 15%)" in text


def test_plan_prints_the_drafter_capacity_of_a_bench_with_remote_modes(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(DRAFTER_BENCH))
    demand = tmp_path / "demand.yaml"
    demand.write_text("models:\n  pair: {requests_per_s: 1, mean_output_tokens: 100}\n")
    assert main(["plan", "--demand", str(demand), "--stats", str(bench)]) == 0
    printed = capsys.readouterr().out
    assert "drafter capacity (measured through an endpoint at batch 1):" in printed
    assert "pays up to 2.50 targets" in printed
