"""`specpool up`: cluster files, and a whole cluster of tiny models through its router."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from cluster.up import DEFAULT_CONFIG, ClusterConfig, ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_default_is_two_tenants_one_endpoint_one_router_pinned_to_two_cores():
    c = ClusterConfig.load()
    assert [t.tenant for t in c.targets] == ["alpha", "beta"]
    assert [e.name for e in c.endpoints] == ["spec"] and c.routers.count == 1
    assert c.endpoints[0].cpus == (0,) and {t.cpus for t in c.targets} == {(1,)}
    assert all(t.threads == 1 for t in c.targets) and c.endpoints[0].threads == 1
    assert c.routers.tenant_weights == {"alpha": 1, "beta": 1}
    assert ClusterConfig.load(DEFAULT_CONFIG) == c


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


@pytest.mark.slow
def test_tiny_cluster_serves_through_the_router_and_stops_cleanly(tmp_path):
    from cluster.demo import AUTO, NONE, run_demo
    from cluster.up import Cluster
    from engine.decoding import generate
    from engine.gguf_loader import model_name
    from engine.model import Llama
    from engine.sampling import SamplingParams
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
        members = {m.role for m in cluster.members()}
        assert members == {"router", "target", "endpoint", "redis"}
        out = io.StringIO()
        report = run_demo(cluster, [(f"p{i}", p) for i, p in enumerate(prompts)], 24, out=out)
        assert "speculation planned by the router" in out.getvalue()
        assert report.same_as_ar == len(prompts)
        assert report.totals[AUTO].tokens == report.totals[NONE].tokens == sum(map(len, expected))
    finally:
        cluster.stop()
    assert all(s.proc.returncode == 0 for s in cluster.servers()), [(s.name, s.logs()) for s in cluster.servers()]
    assert cluster.redis is not None and not cluster.redis.alive()
