"""`specpool up`: cluster files, and a whole cluster of tiny models through its router."""

from __future__ import annotations

import io
import urllib.parse
from pathlib import Path

import pytest
import redis

from specpool.cluster.config import DEFAULT_CONFIG, SMOLLM2_CONFIG, ClusterConfig, ConfigError
from specpool.common.serving import REDIS_URL_ENV

REPO = Path(__file__).resolve().parents[2]


def test_default_is_the_qwen_pair_and_smollm2_sharing_one_endpoint_unpinned():
    """The 1.5B target and SmolLM2 draft on one endpoint (the 0.5B draft, n-gram for both); nothing pinned, every
    server on 2 threads: a target and its endpoint each use both cores while the other waits, so AR on the
    same target runs on every core a plan uses."""
    from specpool.engine.runtime.chunked_models import model_path

    c = ClusterConfig.load()
    assert [t.tenant for t in c.targets] == ["alpha", "beta"]
    assert [t.model for t in c.targets] == [model_path("qwen2.5-coder-1.5b"), None]
    assert c.targets[0].datastore == "", "the default datastore is SmolLM2's tokens"
    assert [e.name for e in c.endpoints] == ["spec"] and c.routers.count == 1
    pair = f"{model_path('qwen2.5-coder-1.5b')},draft={model_path('qwen2.5-coder-0.5b')}"
    assert c.endpoints[0].drafters == (pair, "default")
    assert c.endpoints[0].cpus is None and all(t.cpus is None for t in c.targets)
    assert all(t.threads == 2 for t in c.targets) and c.endpoints[0].threads == 2
    assert c.routers.tenant_weights == {"alpha": 1, "beta": 1}
    assert ClusterConfig.load(DEFAULT_CONFIG) == c


def test_the_smollm2_cluster_is_the_old_default_two_tenants_pinned_to_two_cores():
    c = ClusterConfig.load(SMOLLM2_CONFIG)
    assert [t.tenant for t in c.targets] == ["alpha", "beta"] and all(t.model is None for t in c.targets)
    assert [e.name for e in c.endpoints] == ["spec"] and c.endpoints[0].drafters == () and c.routers.count == 1
    assert c.endpoints[0].cpus == (0,) and {t.cpus for t in c.targets} == {(1,)}
    assert all(t.threads == 1 for t in c.targets) and c.endpoints[0].threads == 1


def test_a_targets_layout_cores_reach_serve_target():
    from specpool.cli import build_parser
    from specpool.cluster.launcher import target_command

    [t] = ClusterConfig.from_dict({"targets": [{"tenant": "a", "layout_cores": 2}]}).targets
    args = target_command(t, None)
    assert build_parser(tools=["serve-target"]).parse_args(args).layout_cores == 2
    assert "--layout-cores" not in target_command(ClusterConfig.load().targets[0], None), "default: its threads"


def test_each_models_first_target_starts_alone_before_the_others():
    """A first run measures each model's step costs in its first target: alone, not beside another measuring."""
    from specpool.cluster.config import TargetSpec
    from specpool.cluster.launcher import target_tiers

    a, b, c, d = (TargetSpec(tenant, model=model) for tenant, model in (("a", "m1"), ("b", "m2"), ("c", "m1"),
                                                                            ("d", "m1")))
    assert target_tiers((a, b, c, d)) == [[a], [b], [c, d]]
    assert target_tiers((a, b)) == [[a], [b]]


def test_examples_load():
    c = ClusterConfig.load(REPO / "cluster" / "examples" / "two-routers.yaml")
    assert c.routers.count == 2 and c.targets[2].endpoint == ""
    free = c.with_free_ports()
    assert free.routers.port == 0 and free.routers.count == 2 and free.targets == tuple(
        t for t in free.targets if t.port == 0)


@pytest.mark.parametrize(("raw", "message"), [
    ({"routerz": {}}, "unknown key(s) ['routerz']"),
    ({"targets": [{"tenant": "a", "max_batch": "eight"}]}, "targets[0].max_batch: expected int"),
    ({"targets": [{"tenant": "a", "endpoint": "nope"}]}, "targets[0].endpoint: no endpoint named 'nope'"),
    ({"targets": [{"tenant": "a"}, {"tenant": "a"}]}, "tenants must be unique"),
    ({"targets": [{"tenant": "a", "cpus": [0, -1]}]}, "targets[0].cpus: expected core numbers"),
    ({"targets": [{"tenant": "a"}], "routers": {"tenant_weights": {"b": 1}}}, "no target with tenant ['b']"),
    ({"endpoints": {"name": "spec"}}, "endpoints: expected a list"),
])
def test_bad_files_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(raw, "f.yaml")
    assert message in str(e.value) and str(e.value).startswith("f.yaml: ")


# -- a running cluster -----------------------------------------------------------------------------------


def test_short_names_in_a_cluster_file_resolve_as_it_loads(tmp_path, monkeypatch):
    """`model:` and a drafter's target and draft= may be short names: the servers get the assembled files; an
    unassembled one is refused as the file loads, naming the key and `make setup`, before any server starts."""
    from specpool.cluster.launcher import endpoint_command, target_command
    from tests.engine.runtime.test_chunked_models import stand_ins

    paths = stand_ins(tmp_path, monkeypatch)
    target, draft = paths["qwen2.5-coder-1.5b"], paths["qwen2.5-coder-0.5b"]
    raw = {"endpoints": [{"drafters": ["qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b"]}],
           "targets": [{"tenant": "a", "model": "qwen2.5-coder-1.5b"}, {"tenant": "b", "model": "default"}]}
    config = ClusterConfig.from_dict(raw)
    assert config.endpoints[0].drafters == (f"{target},draft={draft}",)
    assert [t.model for t in config.targets] == [target, None]
    command = endpoint_command(config.endpoints[0])
    assert command[command.index("--drafter") + 1] == f"{target},draft={draft}"
    command = target_command(config.targets[0], None)
    assert command[command.index("--model") + 1] == target
    (tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").unlink()
    with pytest.raises(ConfigError, match=r"config: endpoints\[0\]\.drafters\[0\]: qwen2.5-coder-0.5b: .* is not "
                                          r"assembled; run `make setup`"):
        ClusterConfig.from_dict(raw)
    raw["endpoints"] = []
    raw["targets"][1]["model"] = "qwen2.5-coder-0.5b"
    with pytest.raises(ConfigError, match=r"config: targets\[1\]\.model: qwen2.5-coder-0.5b: .* run `make setup`"):
        ClusterConfig.from_dict(raw)


@pytest.mark.slow
def test_tiny_cluster_serves_through_the_router_and_stops_cleanly(tmp_path, cpu_kind):
    from specpool.cluster.demo import AUTO, NONE, run_demo
    from specpool.cluster.launcher import Cluster
    from specpool.engine.decoding import generate
    from specpool.engine.runtime.gguf_loader import model_name
    from specpool.engine.runtime.model import Llama
    from specpool.engine.verification.sampling import SamplingParams
    from tests.cluster.test_disaggregation import tiny_files

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    one_core = {"threads": 1, "cpus": None}
    config = ClusterConfig.from_dict({
        "routers": {"count": 1, "tenant_weights": {"alpha": 1, "beta": 1}},
        "endpoints": [{"name": "spec", "drafters": [f"{model_name(gguf)}={gguf},draft={draft}"], **one_core}],
        "targets": [{"tenant": t, "model": str(gguf), "max_batch": 4, "max_context": 128, "datastore": "",
                     "args": ["--draft-tokens", "3"], **one_core} for t in ("alpha", "beta")],
    })
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7] for i in range(3)]
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 24)]

    cluster = Cluster.start(config)
    try:
        # serve-spec's default draft format (auto: Q8_0 blocks where the kernels build, else bf16 only where
        # native) never asks a CPU class for bf16 it lacks: no fallback line in either class.
        assert "using fp32 weights" not in cluster.endpoints["spec"].logs()
        members = {m.role for m in cluster.members()}
        assert members == {"router", "target", "endpoint", "redis"}
        # Each server logs in to Redis as a user of its own, which writes only its own role's records.
        users = {s.name: urllib.parse.urlsplit(s.env[REDIS_URL_ENV]).username for s in cluster.servers()}
        assert users == {"spec": "endpoint-spec", "alpha": "target-alpha", "beta": "target-beta",
                         **{r.name: f"router-{r.name}" for r in cluster.routers}}
        alpha = redis.Redis.from_url(cluster.targets["alpha"].env[REDIS_URL_ENV])
        with alpha, pytest.raises(redis.exceptions.NoPermissionError):
            alpha.hset("specpool:target:beta:127.0.0.1:1", "model", "m")
        out = io.StringIO()
        report = run_demo(cluster, [(f"p{i}", p) for i, p in enumerate(prompts)], 24, out=out)
        auto, ar = report.totals[AUTO], report.totals[NONE]
        # AUTO: the router planned a speculation method for every request (the target runs the method the
        # router forwards and reports it back), and the target verified drafts and accepted some: fewer
        # forwards than tokens after the first. NONE: plain decoding, one forward per token after the first.
        assert "none" not in auto.methods and sum(auto.methods.values()) == len(prompts), auto.methods
        assert auto.drafted > 0 and auto.target_steps < auto.tokens - len(prompts), (auto.drafted, auto.target_steps)
        assert ar.methods == {"none": len(prompts)}, ar.methods
        assert ar.drafted == 0 and ar.target_steps == ar.tokens - len(prompts), (ar.drafted, ar.target_steps)
        assert report.same_as_ar == len(prompts)
        assert report.totals[AUTO].tokens == report.totals[NONE].tokens == sum(map(len, expected))
    finally:
        cluster.stop()
    assert all(s.proc.returncode == 0 for s in cluster.servers()), [(s.name, s.logs()) for s in cluster.servers()]
    assert cluster.redis is not None and not cluster.redis.alive()


@pytest.mark.slow
@pytest.mark.serial  # the plan follows measured step costs: beside another test's servers it drafted ~1 token a step
# Still open in issue 51: with plans no longer dropped on a short run of rejections, 4 runs of 4 here planned the draft
# model for all five prompts (1.33-1.39x), but the clean-clone run at a6a181f (AR at 21 tokens/s, not 24) planned
# n-gram, SSD, n-gram for the last three: after separate_paren_groups (2.76 tokens/step, 1.19x) the draft model's
# predicted speedup fell within the 1.1 margin, so no measured method paid and the untried priors were planned.
@pytest.mark.xfail(reason="issue 51: after a weak prompt the draft model's prediction can fall within the margin, "
                          "and the untried n-gram and SSD priors are planned", strict=False)
def test_the_demo_plans_the_qwen_pair_for_the_15b_and_keeps_ar_tokens():
    """`make run` on the default cluster: 5 HumanEval prompts to the 1.5B target, each planned by the router and
    as AR on the same target. The outputs equal AR's; the router probes the draft model and plans a draft method
    for the later prompts, which verify more than 1.5 tokens a step; the speedup printed is against AR on the
    cores the plans used. No speed threshold: the speedup is the demo's to report (README, `make run`)."""
    import os

    from specpool.cluster.demo import AUTO, NONE, load_prompts, run_demo
    from specpool.cluster.launcher import Cluster

    cluster = Cluster.start(ClusterConfig.load().with_free_ports())
    try:
        out = io.StringIO()
        report = run_demo(cluster, load_prompts("humaneval", 5), 128, out=out)
    finally:
        cluster.stop()
    text = out.getvalue()
    print(text)
    assert report.same_as_ar == 5 and "same tokens as AR: 5/5 prompts" in text
    plans = [r.auto.plan for r in report.results]
    drafting = ("draft_model/", "ssd/")
    assert plans[0].startswith(drafting), plans  # a fresh target: the router's probe (or SSD, on its prior)
    assert all(p.startswith(drafting) for p in plans[-2:]), plans
    drafted = [r.auto for r in report.results if r.auto.plan.startswith(drafting)]
    tokens, steps = sum(len(a.tokens) for a in drafted), sum(len(a.tokens) / a.accept_len for a in drafted)
    assert tokens / steps > 1.5, [a.accept_len for a in drafted]
    # AR ran on the same target, unpinned: on every core the plans used, the target's and its endpoint's.
    cores = len(os.sched_getaffinity(0))
    assert report.ar_cores == report.plan_cores == cores
    assert f"speedup against AR on the target's {cores} cores: every core the plans used" in text
    auto, ar = report.totals[AUTO], report.totals[NONE]
    row = next(line for line in text.splitlines() if line.startswith("speculation planned by the router"))
    assert f"{auto.tokens_per_s / ar.tokens_per_s:.2f}x" in row.split() and report.speedup == auto.tokens_per_s / ar.tokens_per_s


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cluster_whose_member_cannot_start_stops_what_it_started(tmp_path):
    """The router (the last tier) cannot start: the targets, the endpoint and Redis, all up by then,
    are stopped again, and the error names the member and shows its log."""
    from specpool.cluster.launcher import Cluster
    from specpool.engine.runtime.gguf_loader import model_name
    from tests.cluster.test_disaggregation import tiny_files
    from tests.conftest import tagged_processes

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    config = ClusterConfig.from_dict({
        "routers": {"count": 1, "args": ["--no-such-flag"]},
        "endpoints": [{"name": "spec", "drafters": [f"{model_name(gguf)}={gguf},draft={draft}"], "threads": 1}],
        "targets": [{"tenant": "alpha", "model": str(gguf), "max_batch": 2, "max_context": 64, "datastore": "",
                     "threads": 1}],
    })
    before = set(tagged_processes())
    steps = []
    with pytest.raises(RuntimeError) as failure:
        Cluster.start(config, progress=steps.append)
    assert "targets: starting alpha" in "\n".join(steps) and any(s.startswith("alpha: ready") for s in steps)
    message = str(failure.value)
    assert message.startswith("router exited with 2") and "unrecognized arguments: --no-such-flag" in message
    assert set(tagged_processes()) <= before, "a member of the failed cluster is still running"


LAUNCHER = """
import sys, time
from specpool.cluster.processes import start_server
server = start_server("spec", sys.argv[1:])
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_servers_stop_when_their_launcher_dies(tmp_path):
    """A launcher killed outright (a timed-out `specpool bench`, a crashed `specpool up`) runs no cleanup:
    the servers it started notice and drain by themselves."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from specpool.engine.runtime.gguf_loader import model_name
    from tests.cluster.test_disaggregation import tiny_files

    gguf, _ = tiny_files(tmp_path, vocab=64, seed=3)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, "serve-spec", "--port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
         "--drafter", f"{model_name(gguf)}={gguf}", "--threads", "1"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(launcher.stdout.readline())
        assert _alive(server_pid)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 30
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(server_pid):
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("the server outlived its launcher by 30 s")
