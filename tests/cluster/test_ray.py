# Over 400 lines: one Ray cluster per module, shared by the launcher, scaling and placement tests.
"""`specpool up --ray`, `scale`, `down`: a cluster file's members as Ray actors (cluster/ray_launcher.py).

The fast tests check the cluster file's `ray:` keys and the planning (placement groups, command lines);
the slow one runs a three-node Ray cluster on this machine (ray.cluster_utils, every node on 127.0.0.1).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from specpool.cluster.config import ClusterConfig, ConfigError, RaySpec
from specpool.cluster.ray_plan import (
    _free,
    _index,
    bundle,
    placement_groups,
    ray_cpus_needed,
    with_host,
    with_ports,
)

REPO = Path(__file__).resolve().parents[2]


def test_ray_keys_load_with_defaults():
    c = ClusterConfig.from_dict({
        "endpoints": [{"name": "spec", "threads": 2, "ray": {"num_gpus": 1, "resources": {"draft_device": 1}}}],
        "targets": [{"tenant": "alpha", "ray": {"replicas": 2, "placement": "strict_spread"}}, {"tenant": "beta"}],
        "routers": {"ray": {"num_cpus": 0.5}},
    })
    assert c.endpoints[0].ray == RaySpec(num_gpus=1, resources={"draft_device": 1})
    assert c.targets[0].ray.replicas == 2 and c.targets[1].ray == RaySpec()
    assert bundle(c.endpoints[0].ray, c.endpoints[0].threads) == {"CPU": 2, "GPU": 1, "draft_device": 1}
    assert ray_cpus_needed(c) == 2 + 1 * 2 + 1 + 0.5 + 1  # endpoint, alpha x2, beta, router, redis
    assert ClusterConfig.load().targets[0].ray == RaySpec()  # files without the key: the defaults


def test_the_ray_example_loads():
    c = ClusterConfig.load(REPO / "cluster" / "examples" / "ray.yaml")
    assert [(g.name, g.strategy) for g in placement_groups(c)] == [("pack:spec", "STRICT_PACK"),
                                                                 ("spread:alpha", "STRICT_SPREAD")]


@pytest.mark.parametrize(("raw", "message"), [
    ({"targets": [{"tenant": "a", "ray": {"num_gpu": 1}}]}, "targets[0].ray: unknown key(s) ['num_gpu']"),
    ({"targets": [{"tenant": "a", "ray": {"num_cpus": -1}}]}, "targets[0].ray.num_cpus: expected a number >= 0"),
    ({"targets": [{"tenant": "a", "ray": {"resources": {"x": "one"}}}]}, "targets[0].ray.resources.x: expected a number"),
    ({"targets": [{"tenant": "a", "ray": {"resources": [1]}}]}, "targets[0].ray.resources: expected a mapping"),
    ({"targets": [{"tenant": "a", "ray": {"replicas": 0}}]}, "targets[0].ray.replicas: expected an integer >= 1"),
    ({"targets": [{"tenant": "a", "ray": {"max_restarts": -2}}]}, "targets[0].ray.max_restarts: expected an integer"),
    ({"targets": [{"tenant": "a", "ray": {"placement": "pack"}}]}, "targets[0].ray.placement: expected one of"),
    ({"targets": [{"tenant": "a", "ray": {"placement": "with_endpoint"}}]}, "targets[0].ray.placement: with_endpoint"),
    ({"endpoints": [{"name": "e", "ray": {"replicas": 2}}]}, "endpoints[0].ray: replicas and placement are for targets"),
    ({"routers": {"ray": ["num_cpus"]}}, "routers.ray: expected a mapping"),
])
def test_bad_ray_keys_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(raw, "f.yaml")
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize(("targets", "groups"), [
    ([{"tenant": "a"}], []),  # spread: Ray's SPREAD strategy, no group
    ([{"tenant": "a", "ray": {"replicas": 3, "placement": "strict_spread"}}],
     [("spread:a", "STRICT_SPREAD", ["target:a:0", "target:a:1", "target:a:2"])]),
    ([{"tenant": "a", "ray": {"replicas": 1, "placement": "strict_spread"}}], []),  # one replica: nothing to spread
    ([{"tenant": "a", "ray": {"placement": "with_endpoint", "replicas": 2}}, {"tenant": "b", "endpoint": "f"},
      {"tenant": "c", "endpoint": "f", "ray": {"placement": "with_endpoint"}}],
     [("pack:e", "STRICT_PACK", ["endpoint:e", "target:a:0", "target:a:1"]),
      ("pack:f", "STRICT_PACK", ["endpoint:f", "target:c:0"])]),
])
def test_placement_groups(targets, groups):
    c = ClusterConfig.from_dict({"endpoints": [{"name": "e"}, {"name": "f"}], "targets": targets})
    assert [(g.name, g.strategy, [n for n, _ in g.members]) for g in placement_groups(c)] == groups


def test_member_indices():
    assert [_index(n) for n in ("endpoint:spec", "endpoint:spec:2", "target:alpha:0", "target:a:11")] == [0, 2, 0, 11]
    assert _free([0, 2], 2) == [1, 3] and _free([], 1) == [0]


def test_members_listen_on_their_node_and_keep_their_ports():
    args = ["serve-spec", "--port", "0", "--metrics-port", "0", "--host", "0.0.0.0"]  # a file's own args win
    assert with_host(args, "endpoint", "10.0.0.7") == [
        "serve-spec", "--host", "10.0.0.7", "--advertise-host", "10.0.0.7", "--channel-host", "10.0.0.7",
        "--port", "0", "--metrics-port", "0", "--host", "0.0.0.0"]
    assert with_host(["serve-router", "--port", "0"], "router", "h") == ["serve-router", "--host", "h", "--port", "0"]
    ports = {"--port": 5, "--metrics-port": 6, "--http-port": 7}
    assert with_ports(["serve-router", "--port", "0", "--metrics-port", "0"], ports) == [
        "serve-router", "--port", "5", "--metrics-port", "6"]


# -- a three-node Ray cluster on this machine -------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_nodes():
    """Three Ray nodes on 127.0.0.1, each with a custom resource naming it (node_a is the head)."""
    # Ray resolves a loopback cluster address to this host's interface address unless told that this
    # is no multi-host cluster; read when ray is first imported. The tests send traffic to 127.0.0.1 only.
    previous = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the `specpool` commands the tests run inherit it
    import ray
    from ray.cluster_utils import Cluster

    node = {"node_ip_address": "127.0.0.1", "num_cpus": 8, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node_a": 100},
                                                            "include_dashboard": False})
    for name in ("node_b", "node_c"):
        cluster.add_node(**node, resources={name: 100})
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = previous


def _node_ids() -> dict[str, str]:
    import ray

    return {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in n["Resources"] if r.startswith("node_")}


def _ray_cli(cluster, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`specpool ARGS --ray ADDRESS` in a process of its own, as an operator runs it."""
    out = subprocess.run([sys.executable, "-m", "specpool.cli", *args, "--ray", cluster.address,
                          "--node-ip-address", "127.0.0.1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         check=False)
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    return out


def _metric(info: dict, sample: str = "specpool_target_generated_tokens_total") -> float:
    """A member's sample summed over its series (read with the cluster's metrics token)."""
    from specpool.cluster.ray_launcher import RayCluster

    token = RayCluster.attach().spec["metrics_token"]
    request = urllib.request.Request(f"http://{info['address'].rpartition(':')[0]}:{info['metrics_port']}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{sample}(?:{{.*}})? (\S+)$", text, re.MULTILINE))


def _cleanup(namespace: str) -> None:
    from specpool.cluster.ray_launcher import RayCluster
    from specpool.cluster.ray_members import _named_actors

    if _named_actors(namespace):
        RayCluster.attach(namespace=namespace).down(grace_s=5)


def _leftovers(namespace: str) -> tuple[list[str], list[str]]:
    from ray.util import placement_group_table

    from specpool.cluster.ray_members import _named_actors

    groups = [g["name"] for g in placement_group_table().values()
              if g.get("name", "").startswith(f"{namespace}:") and g.get("state") != "REMOVED"]
    return _named_actors(namespace), groups


@pytest.mark.slow
def test_a_ray_start_that_fails_leaves_nothing(ray_nodes, tmp_path):
    """A pairing no node can hold (the endpoint's resources on node_c, its packed target's on node_a), and
    a router that cannot start after Redis did: both raise, and leave no actor, group or server."""
    from specpool.cluster.ray_launcher import RayCluster
    from tests.conftest import tagged_processes

    before = set(tagged_processes())
    unplaceable = ClusterConfig.from_dict({
        "endpoints": [{"name": "spec", "ray": {"resources": {"node_c": 1}}}],
        "targets": [{"tenant": "alpha", "ray": {"placement": "with_endpoint", "resources": {"node_a": 1}}}],
    })
    try:
        with pytest.raises(RuntimeError, match="placement group pack:spec"):
            RayCluster.start(unplaceable, namespace="failing", timeout_s=5)
        assert _leftovers("failing") == ([], [])
        bad_router = tmp_path / "bad-router.yaml"
        bad_router.write_text(yaml.safe_dump({"routers": {"args": ["--no-such-flag"], "ray": {"num_cpus": 0.5}},
                                              "redis": {"ray": {"num_cpus": 0.5}}}))
        failure = _ray_cli(ray_nodes, "up", "--config", str(bad_router), "--namespace", "failing", ok=False).stderr
        assert "RuntimeError: router failed to start" in failure, failure
        assert "unrecognized arguments: --no-such-flag" in failure
        assert _leftovers("failing") == ([], [])
        servers = {p: c for p, c in tagged_processes().items() if p not in before and ("redis-server" in c or " serve-" in c)}
        assert not servers, servers
    finally:
        _cleanup("failing")


@pytest.mark.slow
def test_members_on_their_nodes_restart_scale_and_down(ray_nodes, tmp_path):
    import grpc
    import ray

    from specpool.cluster.ray_launcher import RayCluster
    from specpool.common.speculation import method_to_pb, sampling_to_pb
    from specpool.engine.decoding import generate
    from specpool.engine.method import Method
    from specpool.engine.runtime.gguf_loader import model_name
    from specpool.engine.runtime.model import Llama
    from specpool.engine.verification.sampling import SamplingParams
    from specpool_client import generate_result
    from specpool_client.v1 import target_pb2 as pb
    from specpool_client.v1 import target_pb2_grpc
    from tests.cluster.test_disaggregation import tiny_files
    from tests.conftest import tagged_processes

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    light = {"num_cpus": 0.5, "resources": {"node_a": 1}}
    target = {"model": str(gguf), "max_batch": 4, "max_context": 128, "datastore": "", "threads": 1,
              "args": ["--draft-tokens", "3"]}
    raw = {
        "redis": {"ray": light},
        "routers": {"count": 1, "tenant_weights": {"alpha": 1, "beta": 1}, "ray": light},
        "endpoints": [{"name": "spec", "drafters": [f"{model_name(gguf)}={gguf},draft={draft}"], "threads": 1,
                       "ray": {"resources": {"node_c": 1}}}],
        "targets": [{"tenant": "alpha", **target, "ray": {"resources": {"node_a": 1}}},
                    {"tenant": "beta", **target, "ray": {"resources": {"node_b": 1}}}],
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7] for i in range(4)]
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 24)]

    # `specpool up --ray` from a process of its own, which returns; the members stay, found by name.
    started = time.monotonic()
    up = _ray_cli(ray_nodes, "up", "--config", str(path), "--timeout-s", "240").stdout
    timings = {"up": time.monotonic() - started}
    try:
        cluster = RayCluster.attach()
        assert "specpool cluster up on Ray" in up and "target    alpha:0" in up, up
        # Every member on the node its resources name.
        nodes, infos = _node_ids(), cluster.infos()
        where = {name: info["node_id"] for name, info in infos.items()}
        assert where == {"redis:registry": nodes["node_a"], "router:router": nodes["node_a"],
                         "endpoint:spec": nodes["node_c"], "target:alpha:0": nodes["node_a"],
                         "target:beta:0": nodes["node_b"]}, where
        assert all(i["address"].startswith("127.0.0.1:") for i in infos.values())

        stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel("alpha"))

        def ask(i: int, method=None):
            result = generate_result(stub, pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=prompts[i]), max_tokens=24, sampling=sampling_to_pb(SamplingParams()),
                speculation=pb.SpeculationPreference(method=method_to_pb(method))), timeout=120)
            return list(result.completions[0].token_ids)

        # Greedy through the router equals AR, speculating (the router plans) and not.
        assert [ask(i) for i in range(len(prompts))] == expected
        assert [ask(i, Method.NONE) for i in range(len(prompts))] == expected

        # Kill alpha's actor: Ray restarts it on its node, a new server registers; no request is lost.
        old = infos["target:alpha:0"]
        done, failures, stop = [], [], threading.Event()

        def traffic():
            i = 0
            while not stop.is_set():
                try:
                    done.append(ask(i % len(prompts)) == expected[i % len(prompts)])
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")
                i += 1

        senders = [threading.Thread(target=traffic) for _ in range(2)]
        for s in senders:
            s.start()
        killed = time.monotonic()
        os.kill(old["actor_pid"], signal.SIGKILL)
        new = None
        while time.monotonic() - killed < 180:
            new = cluster.infos("target:alpha").get("target:alpha:0")
            if new is not None and new["actor_pid"] != old["actor_pid"]:
                break
            time.sleep(0.5)
        timings["restart"] = time.monotonic() - killed
        assert new is not None and new["actor_pid"] != old["actor_pid"], "the actor was not restarted"
        assert new["node_id"] == old["node_id"] and new["address"] != old["address"]
        sent_during = len(done)
        time.sleep(3)  # traffic goes on after the restart too
        stop.set()
        for s in senders:
            s.join(150)
        assert not failures, failures
        assert all(done) and sent_during > 0 and len(done) > sent_during, (len(done), sent_during)

        # `specpool scale alpha 2` from another process: the new replica starts taking traffic.
        started = time.monotonic()
        out = _ray_cli(ray_nodes, "scale", "alpha", "2").stdout
        timings["scale"] = time.monotonic() - started
        assert "added target:alpha:1" in out, out
        replica = cluster.infos("target:alpha")["target:alpha:1"]
        assert replica["node_id"] == nodes["node_a"]
        for _ in range(10):
            assert [ask(i) for i in range(len(prompts))] == expected
            if _metric(replica) > 0:
                break
        assert _metric(replica) > 0, "the new replica took no request"

        # `specpool scale --endpoint spec 2`: the next replica drafts on the new instance, which serves it.
        out = _ray_cli(ray_nodes, "scale", "spec", "2", "--endpoint").stdout
        assert "added endpoint:spec:1" in out, out
        second = cluster.infos("endpoint")["endpoint:spec:1"]
        assert second["node_id"] == nodes["node_c"]
        assert "added target:alpha:2" in _ray_cli(ray_nodes, "scale", "alpha", "3").stdout
        assert cluster.infos("target:alpha")["target:alpha:2"]["drafts_on"] == second["address"]
        for _ in range(10):
            assert [ask(i, Method.DRAFT_MODEL) for i in range(len(prompts))] == expected
            if _metric(second, "specpool_spec_drafted_tokens_total") > 0:
                break
        assert _metric(second, "specpool_spec_drafted_tokens_total") > 0, "the new instance drafted nothing"

        # A router comes back on its node and its address: clients keep their channel.
        router = cluster.infos("router")["router:router"]
        killed = time.monotonic()
        os.kill(router["actor_pid"], signal.SIGKILL)
        while time.monotonic() - killed < 120:
            again = cluster.infos("router").get("router:router")
            if again is not None and again["actor_pid"] != router["actor_pid"]:
                break
            time.sleep(0.5)
        timings["router restart"] = time.monotonic() - killed
        assert again["address"] == router["address"] and again["node_id"] == router["node_id"], (again, router)
        assert [ask(i) for i in range(len(prompts))] == expected

        # `specpool down` from another process: nothing of the cluster is left.
        server_pids = [i["server_pid"] for i in cluster.infos().values() if i]
        started = time.monotonic()
        _ray_cli(ray_nodes, "down")
        timings["down"] = time.monotonic() - started
        assert _leftovers("specpool") == ([], [])
        alive = {p: c for p, c in tagged_processes().items() if p in server_pids or "redis-server" in c
                 or " serve-" in c}
        assert not alive, alive
        print(f"timings (s): {', '.join(f'{k} {v:.1f}' for k, v in timings.items())}")
    finally:
        _cleanup("specpool")
    assert ray.is_initialized()


@pytest.mark.slow
def test_placement_groups_pair_and_spread(ray_nodes, tmp_path):
    """with_endpoint: a target on its endpoint's node (STRICT_PACK), and a replica added later beside it
    too; strict_spread: a tenant's replicas on distinct nodes (STRICT_SPREAD). An endpoint's second
    instance takes the next target; scaled back, that target is replaced by one on the first."""
    from specpool.cluster.ray_launcher import RayCluster
    from specpool.engine.runtime.gguf_loader import model_name
    from tests.cluster.test_disaggregation import tiny_files

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    target = {"model": str(gguf), "max_batch": 2, "max_context": 64, "datastore": "", "threads": 1}
    config = ClusterConfig.from_dict({
        "redis": {"ray": {"num_cpus": 0.5}},
        "routers": {"count": 0},
        "endpoints": [{"name": "spec", "drafters": [f"{model_name(gguf)}={gguf},draft={draft}"], "threads": 1,
                       "ray": {"resources": {"node_c": 1}}}],
        "targets": [{"tenant": "alpha", **target, "ray": {"placement": "with_endpoint"}},
                    {"tenant": "beta", **target, "ray": {"placement": "strict_spread", "replicas": 2}}],
    })
    cluster = RayCluster.start(config, namespace="placed", timeout_s=240)
    try:
        nodes, where = _node_ids(), {n: i["node_id"] for n, i in cluster.infos().items()}
        assert where["endpoint:spec"] == where["target:alpha:0"] == nodes["node_c"], where
        assert where["target:beta:0"] != where["target:beta:1"], where
        assert cluster.scale("alpha", 2) == (["target:alpha:1"], [])
        assert cluster.infos("target:alpha")["target:alpha:1"]["node_id"] == nodes["node_c"]
        assert cluster.scale("beta", 1) == ([], ["target:beta:1"])
        assert list(cluster.actors("target:beta")) == ["target:beta:0"]

        assert cluster.scale_endpoint("spec", 2) == (["endpoint:spec:1"], [])
        endpoints = {n: i["address"] for n, i in cluster.infos("endpoint").items()}
        assert cluster.scale("alpha", 3) == (["target:alpha:2"], [])
        alpha = cluster.infos("target:alpha")
        assert alpha["target:alpha:2"]["drafts_on"] == endpoints["endpoint:spec:1"], "the least used instance"
        assert alpha["target:alpha:2"]["node_id"] == nodes["node_c"]  # with_endpoint: beside its instance
        assert [alpha[f"target:alpha:{i}"]["drafts_on"] for i in (0, 1)] == [endpoints["endpoint:spec"]] * 2
        assert cluster.scale_endpoint("spec", 1) == ([], ["endpoint:spec:1"])
        alpha = cluster.infos("target:alpha")
        assert sorted(alpha) == ["target:alpha:0", "target:alpha:1", "target:alpha:3"], "alpha:2 replaced"
        assert {i["drafts_on"] for i in alpha.values()} == {endpoints["endpoint:spec"]}
        assert list(cluster.endpoint_instances("spec")) == ["endpoint:spec"]
        with pytest.raises(ValueError, match="instances must be >= 1"):
            cluster.scale_endpoint("spec", 0)
    finally:
        cluster.down()
    assert _leftovers("placed") == ([], [])


def _records(admin) -> list[str]:
    """The members' registry records (leases left out: they come and go)."""
    return sorted(k.decode() for pattern in ("specpool:target:*", "specpool:endpoint:*")
                  for k in admin.scan_iter(pattern))


def _server_env(pid: int, name: str) -> str:
    """A variable of a running server's environment (what it was started with)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in entries if e.startswith(name.encode() + b"="))


@pytest.mark.slow
def test_each_ray_member_logs_in_to_redis_as_its_own_user(ray_nodes, tmp_path):
    """As `specpool up`: every target, endpoint and router gets a Redis user of its own (member_acl's
    rules), never the default password; it writes its own record and is refused another member's. A
    Redis actor that Ray restarts gets the users back (the members register again), and a replica
    added by `scale` shares its tenant's user."""
    import ray
    import redis as redis_py

    from specpool.cluster.ray_launcher import RayCluster
    from specpool.common.serving import REDIS_URL_ENV
    from specpool.engine.runtime.gguf_loader import model_name
    from tests.cluster.test_disaggregation import tiny_files

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    light = {"num_cpus": 0.5}
    target = {"model": str(gguf), "max_batch": 2, "max_context": 64, "datastore": "", "threads": 1, "ray": light}
    config = ClusterConfig.from_dict({
        "redis": {"ray": light},
        "routers": {"count": 1, "tenant_weights": {"alpha": 1, "beta": 1}, "ray": light},
        "endpoints": [{"name": "spec", "drafters": [f"{model_name(gguf)}={gguf},draft={draft}"], "threads": 1,
                       "ray": light}],
        "targets": [{"tenant": "alpha", **target}, {"tenant": "beta", **target}],
    })
    cluster = RayCluster.start(config, namespace="users", timeout_s=240)
    try:
        admin_url = cluster.spec["redis_url"]
        password = redis_py.Redis.from_url(admin_url).connection_pool.connection_kwargs["password"]
        urls = {name: _server_env(info["server_pid"], REDIS_URL_ENV)
                for name, info in cluster.infos().items() if name != "redis:registry"}
        users = {name: redis_py.Redis.from_url(url).connection_pool.connection_kwargs for name, url in urls.items()}
        assert {n: u.get("username") for n, u in users.items()} == {
            "endpoint:spec": "endpoint-spec", "router:router": "router-router",
            "target:alpha:0": "target-alpha", "target:beta:0": "target-beta"}, users
        assert all(password not in url for url in urls.values()), "a member holds the default password"

        own = {"target:alpha:0": ("specpool:target:alpha:x", "specpool:target:beta:x"),
               "target:beta:0": ("specpool:target:beta:x", "specpool:target:alpha:x"),
               "endpoint:spec": ("specpool:endpoint:spec", "specpool:endpoint:other")}

        def check_acls() -> None:
            for name, (mine, theirs) in own.items():
                with redis_py.Redis.from_url(urls[name], socket_timeout=5) as r:
                    assert r.hset(mine, "probe", "1") == 1, name  # a field routers ignore
                    if mine.endswith(":x"):
                        assert r.delete(mine) == 1
                    with pytest.raises(redis_py.exceptions.NoPermissionError):
                        r.hset(theirs, "id", "x")
                    with pytest.raises(redis_py.exceptions.NoPermissionError):
                        r.flushall()
            with redis_py.Redis.from_url(urls["router:router"], socket_timeout=5) as r:
                assert "specpool:endpoint:spec" in {k.decode() for k in r.scan_iter("specpool:*")}  # routers read
                for refused in (("FLUSHALL",), ("ACL", "LIST"), ("CONFIG", "GET", "requirepass")):
                    with pytest.raises(redis_py.exceptions.NoPermissionError):
                        r.execute_command(*refused)

        check_acls()

        # Ray restarts a killed Redis actor (empty: no data_dir): its users come back, and every member
        # registers again under its own.
        with redis_py.Redis.from_url(admin_url, socket_timeout=5) as admin:
            registered = _records(admin)
        assert any(k.startswith("specpool:target:alpha:") for k in registered), registered
        old = cluster.infos("redis")["redis:registry"]
        os.kill(old["actor_pid"], signal.SIGKILL)
        deadline, new, again = time.monotonic() + 120, None, []
        while time.monotonic() < deadline:  # the old redis-server lives on until the new actor ends it
            new = cluster.infos("redis").get("redis:registry")
            if new is not None and new["actor_pid"] != old["actor_pid"]:
                break
            time.sleep(0.5)
        assert new is not None and new["server_pid"] != old["server_pid"], "Redis was not restarted"
        while time.monotonic() < deadline:
            try:
                with redis_py.Redis.from_url(admin_url, socket_timeout=2) as admin:
                    again = _records(admin)
                if again == registered:
                    break
            except redis_py.RedisError:
                pass
            time.sleep(0.5)
        assert again == registered, (again, registered)
        check_acls()

        # A replica added later logs in as its tenant's user, with the same URL.
        assert cluster.scale("alpha", 2) == (["target:alpha:1"], [])
        replica = cluster.infos("target:alpha")["target:alpha:1"]
        assert _server_env(replica["server_pid"], REDIS_URL_ENV) == urls["target:alpha:0"]
    finally:
        cluster.down()
    assert _leftovers("users") == ([], [])
    assert ray.is_initialized()
