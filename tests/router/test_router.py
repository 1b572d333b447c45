# Over 400 lines: one router process per scenario, sharing its Redis and fake-target fixtures.
"""The router as a process, against a real Redis: in-process fake targets (no model) for placement and
speculation decisions, real tiny serve-target/serve-spec processes for leases and a Redis restart.

- the router declines to speculate when no method is predicted to beat plain decoding;
- placement follows the load the replicas report; two router replicas place sessions the same way;
- a tenant's share of draft slots holds through the router while a greedy tenant asks for more;
- /capacity (JSON) carries what ClusterStateService does; per-tenant leases only for operators (the metrics
  token), and ClusterStateService shows a tenant its own alone;
- after 200 requests that complete, are cancelled or are abandoned by their client, no slot is held;
- a Redis restart loses no in-flight request, and the registry rebuilds from heartbeats.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.registry import Heartbeat, Registry
from specpool.common.registry_schema import PREFIX, member_acl
from specpool.common.security import Security
from specpool.common.serving import METRICS_TOKEN_ENV, build_server
from specpool.common.speculation import finish_reason_name
from specpool.engine.runtime.gguf_loader import model_name
from specpool.router.capacity import capacity_json
from specpool_client import generate_result
from specpool_client.v1 import cluster_pb2, cluster_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import ONE_THREAD, tiny_files
from tests.pki import CA, channel

pytestmark = pytest.mark.slow

DRAFT, NGRAM, NONE, AUTO = (pb.SPECULATION_METHOD_DRAFT_MODEL, pb.SPECULATION_METHOD_NGRAM,
                            pb.SPECULATION_METHOD_NONE, pb.SPECULATION_METHOD_UNSPECIFIED)



class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """A TargetService without a model: records what the router sent, answers with one token, and
    holds each request until `gate` is set. Registers itself like serve-target does, its member id as
    its tenant, and serves with mutual TLS as target/<member id> (routers dial it by that name)."""

    def __init__(self, member_id: str, model: str, redis_url: str, draft: float, ngram: float,
                 spec_endpoint: str = ""):
        self.member_id, self.model = member_id, model
        self.draft, self.ngram, self.spec_endpoint = draft, ngram, spec_endpoint
        self.received: list[pb.GenerateRequest] = []
        self.busy = 0  # sequences its heartbeats report running besides the requests it holds
        self.gate = threading.Event()
        self.gate.set()
        self._in_flight = 0
        self._lock = threading.Lock()
        self.server, self.port = build_server(0, host="127.0.0.1",
                                              credentials=Security.load(CA.dir, "target", member_id))
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, self.server)
        self.server.start()
        self.heartbeat = Heartbeat(redis_url, "target", member_id, self.fields, ttl_s=1.0, interval_s=0.1).start()

    def fields(self) -> dict:
        return {"address": f"127.0.0.1:{self.port}", "model": self.model, "tenant": self.member_id, "max_batch": 16,
                "running": self._in_flight + self.busy, "queued": 0, "spec_endpoint": self.spec_endpoint,
                "predicted_speedup_draft": self.draft, "predicted_speedup_ngram": self.ngram,
                "methods": ["draft_model", "ngram"]}

    def methods(self) -> dict[str, int]:
        return {r.request_id: r.speculation.method for r in self.received}

    def _enter(self, request) -> None:
        with self._lock:
            self.received.append(request)
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _hold(self, context) -> bool:
        while not self.gate.wait(0.05):
            if not context.is_active():
                return False
        return True

    def Generate(self, request, context):
        self._enter(request)
        try:
            yield pb.GenerateResponse(request_id=request.request_id, delta=pb.TokenDelta(token_ids=[5]))
            if self._hold(context):
                yield pb.GenerateResponse(request_id=request.request_id, final=self._result(request))
        finally:
            self._leave()

    def Cancel(self, request, context):
        return pb.CancelResponse(cancelled=False)

    def GetInfo(self, request, context):
        return pb.GetInfoResponse(service_id=self.member_id, model=self.model, vocab_size=64, max_batch=16)

    def _result(self, request) -> pb.GenerateResult:
        return pb.GenerateResult(request_id=request.request_id, model=self.model, completions=[
            pb.Completion(token_ids=[5], finish_reason=pb.FINISH_REASON_LENGTH)])

    def close(self) -> None:
        self.gate.set()
        self.heartbeat.stop()
        self.server.stop(0)


# -- the cluster: Redis, two routers, fake targets, and a tiny real pool ---------------------------------


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis()
    yield server
    server.close()


def start_router(name: str, redis_url: str, env: dict[str, str] | None = None) -> ServerProcess:
    return start_server(name, ["serve-router", "--port", "0", "--metrics-port", "0", "--redis", redis_url,
                               "--tenant-weights", "alpha=1,beta=1", "--name", name], env=env)


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    """Two routers; a tiny serve-spec (16 draft slots) and two tiny serve-targets drafting on it."""
    gguf, draft = tiny_files(tmp_path_factory.mktemp("router"), vocab=64, seed=3)
    url = redis_server.url
    servers: list[ServerProcess] = []
    with ThreadPoolExecutor(3) as pool:
        routers = [pool.submit(start_router, n, url) for n in ("router-a", "router-b")]
        spec = start_server("spec", ["serve-spec", "--port", "0", "--metrics-port", "0", "--drafter",
                                     f"{model_name(gguf)}={gguf},draft={draft}", "--max-sessions", "16",
                                     "--endpoint-id", "spec-1", "--redis", url, *ONE_THREAD])
        servers.append(spec)
        targets = [pool.submit(start_server, t, [
            "serve-target", "--model", str(gguf), "--port", "0", "--metrics-port", "0", "--tenant", t,
            "--spec-endpoint", spec.address, "--datastore", "", "--draft-tokens", "2", "--max-batch", "8",
            "--max-context", "160", "--redis", url, *ONE_THREAD]) for t in ("target-1", "target-2")]
        servers += [f.result() for f in routers + targets]
    registry = Registry(url)
    try:
        wait_for(lambda: len([t for t in registry.targets() if t.model == model_name(gguf)]) == 2
                 and registry.endpoints())
        yield {"model": model_name(gguf), "routers": servers[1:3], "spec": servers[0], "targets": servers[3:],
               "registry": registry, "redis": redis_server}
    finally:
        registry.close()
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(ServerProcess.stop, servers))


@pytest.fixture(scope="module")
def fakes(redis_server, cluster):
    """Two fake replicas of "fake-model" drafting on a registered fake endpoint with 4 slots."""
    url = redis_server.url
    endpoint = Heartbeat(url, "endpoint", "fake-ep", lambda: {
        "address": "127.0.0.1:1", "models": ["fake-model"], "max_sessions": 4}, ttl_s=1.0, interval_s=0.1).start()
    replicas = [FakeTarget(f"fake-{x}", "fake-model", url, draft=1.5, ngram=1.2, spec_endpoint="127.0.0.1:1")
                for x in "ab"]
    wait_for(lambda: len([t for t in cluster["registry"].targets() if t.model == "fake-model"]) == 2)
    yield replicas
    for r in replicas:
        r.close()
    endpoint.stop()


_channels: dict[tuple[str, str], grpc.Channel] = {}


def stub(server: ServerProcess, tenant: str = "tester") -> target_pb2_grpc.TargetServiceStub:
    """A tenant's client of a router (its bearer token names the tenant), or of a target."""
    key = (server.address, tenant)
    if key not in _channels:
        _channels[key] = channel(server.address, "router" if server.name.startswith("router") else "target",
                                 tenant=tenant)
    return target_pb2_grpc.TargetServiceStub(_channels[key])


def request(model: str, request_id: str = "", method: int = AUTO, max_tokens: int = 4, session_id: str = ""):
    return pb.GenerateRequest(request_id=request_id, model=model, prompt_ids=pb.TokenIds(ids=[3, 7, 9, 11, 3, 7]),
                              max_tokens=max_tokens, ignore_eos=True, session_id=session_id,
                              speculation=pb.SpeculationPreference(method=method))


def wait_for_model(router: ServerProcess, model: str) -> None:
    """Until the router's snapshot lists the model (it re-reads the registry every 0.25 s)."""
    def listed():
        data = json.load(urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity"))
        return any(p["model"] == model for p in data["pools"])
    wait_for(listed)


# -- decisions and placement, against fake targets -----------------------------------------------------


def test_the_router_declines_to_speculate_when_no_method_is_predicted_to_pay(cluster, redis_server):
    slow = FakeTarget("slow-1", "slow-model", redis_server.url, draft=0.7, ngram=0.9)
    try:
        router = cluster["routers"][0]
        wait_for_model(router, "slow-model")
        s = stub(router)
        generate_result(s, request("slow-model", "auto"))
        generate_result(s, request("slow-model", "ngram", method=NGRAM))
        generate_result(s, request("slow-model", "draft", method=DRAFT))
        assert slow.methods() == {"auto": NONE, "ngram": NGRAM, "draft": NONE}
        assert router.metric_total("specpool_router_decisions_total", model="slow-model", plan="none",
                      reason="no_speedup") == 1
        assert router.metric_total("specpool_router_decisions_total", model="slow-model", plan="ngram",
                      reason="requested") == 1
        assert router.metric_total("specpool_router_decisions_total", model="slow-model", plan="none",
                      reason="no_endpoint") == 1
        with pytest.raises(grpc.RpcError) as err:
            generate_result(s, request("no-such-model"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model:")
        with pytest.raises(grpc.RpcError) as err:
            generate_result(s, request(""))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, "several models: the request must name one"
    finally:
        slow.close()


class TornDownTarget(FakeTarget):
    """Ends every Generate with CANCELLED before any token: what a client sees when its replica's
    process dies mid-call and gRPC reports the torn stream as cancelled (seen once from a SIGKILLed
    Ray actor, tests/cluster/test_ray.py), rather than UNAVAILABLE."""

    def Generate(self, request, context):
        self._enter(request)
        try:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        finally:
            self._leave()


def test_a_replica_call_ending_cancelled_while_the_client_waits_is_placed_again(cluster, redis_server):
    torn = TornDownTarget("torn-1", "torn-model", redis_server.url, draft=0.7, ngram=0.9)
    good = FakeTarget("good-1", "torn-model", redis_server.url, draft=0.7, ngram=0.9)
    try:
        router = cluster["routers"][0]
        wait_for(lambda: len([t for t in cluster["registry"].targets() if t.model == "torn-model"]) == 2)
        wait_for_model(router, "torn-model")
        results = [generate_result(stub(router), request("torn-model", f"torn-{i}")) for i in range(8)]
        assert all(list(r.completions[0].token_ids) == [5] for r in results)
        assert torn.received, "the torn-down replica was never tried: the test proves nothing"
        assert len(good.received) == 8
    finally:
        torn.close()
        good.close()


def reported_running(router: ServerProcess, model: str) -> dict[str, int]:
    """Replica id -> running sequences, as the router's snapshot has them (its /capacity)."""
    data = json.load(urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity"))
    return {t["id"]: t["running"] for p in data["pools"] if p["model"] == model for t in p["targets"]}


def test_placement_follows_the_load_the_replicas_report(cluster, fakes):
    """One replica reports 15 of its 16 sequences busy, the other none; then the other way round. Each
    phase sends 60 requests one at a time (each done before the next), and at most 18 may land on the
    busy replica.

    The router draws in proportion to free capacity + 0.01: the busy replica has 1/16 free (0/16 while
    a request of ours is in flight), the idle one 16/16 (15/16), so it gets a request with p <= 0.0711;
    P(more than 18 of 60) = 1.8e-8 a phase, 3.6e-8 for the test. A router blind to load (the hash
    alone, or a coin) sends each request to either with p = 0.5 over request ids: P(at most 18 of 60)
    = 1.3e-3 a phase, 1.8e-6 for both phases, and one that always picks the same replica fails one."""
    router = cluster["routers"][0]
    wait_for_model(router, "fake-model")
    s = stub(router)
    by_id = {f.member_id: f for f in fakes}
    try:
        for phase, busy in enumerate(("fake-a", "fake-b")):
            idle = next(i for i in by_id if i != busy)
            by_id[busy].busy, by_id[idle].busy = 15, 0
            want = {busy: 15, idle: 0}
            wait_for(lambda want=want: reported_running(router, "fake-model") == want)
            for i in range(60):
                generate_result(s, request("fake-model", f"load-{phase}-{i}"))
            placed = Counter(f.member_id for f in fakes for r in f.received
                             if r.request_id.startswith(f"load-{phase}-"))
            assert sum(placed.values()) == 60 and placed[busy] <= 18, (f"{busy} reports 15/16 busy", placed)
    finally:
        for f in fakes:
            f.busy = 0
    wait_for(lambda: reported_running(router, "fake-model") == {"fake-a": 0, "fake-b": 0})


def test_two_router_replicas_place_sessions_the_same_way(cluster, fakes):
    a, b = (stub(r) for r in cluster["routers"])
    for r in cluster["routers"]:
        wait_for_model(r, "fake-model")

    def replica_of(request_id: str) -> str:
        [where] = [f.member_id for f in fakes if any(r.request_id == request_id for r in f.received)]
        return where

    for i in range(12):
        generate_result(a, request("fake-model", f"s{i}-a", session_id=f"session-{i}"))
        generate_result(b, request("fake-model", f"s{i}-b", session_id=f"session-{i}"))
        assert replica_of(f"s{i}-a") == replica_of(f"s{i}-b"), i
    homes = {replica_of(f"s{i}-a") for i in range(12)}
    assert homes == {"fake-a", "fake-b"}, "sessions are spread, each kept on its own replica"


def test_a_tenants_share_of_draft_slots_holds_through_the_router(cluster, fakes):
    """fake-ep has 4 slots, alpha and beta weigh 1 each: 2 are reserved for each."""
    router = cluster["routers"][1]
    registry = cluster["registry"]
    wait_for_model(router, "fake-model")
    no_slot_before = router.metric_total("specpool_router_decisions_total", model="fake-model", plan="ngram",
                            reason="no_slot")
    for f in fakes:
        f.gate.clear()
    calls = []
    try:
        def send(who: str, i: int):
            call = stub(router, who).Generate(request("fake-model", f"{who}-{i}", method=DRAFT))
            next(call)
            calls.append(call)

        for i in range(5):
            send("alpha", i)  # greedy
        for i in range(3):
            send("beta", i)
        methods = {}
        for f in fakes:
            methods.update(f.methods())
        alpha = Counter(methods[f"alpha-{i}"] for i in range(5))
        beta = Counter(methods[f"beta-{i}"] for i in range(3))
        assert alpha == {DRAFT: 2, NGRAM: 3}, "alpha falls back to n-gram past its guarantee"
        assert beta == {DRAFT: 2, NGRAM: 1}, "beta's two reserved slots were still free"
        assert registry.held("fake-ep") == {"alpha": 2, "beta": 2}
        assert router.metric_total("specpool_router_decisions_total", model="fake-model", plan="ngram",
                      reason="no_slot") - no_slot_before == 4
    finally:
        for f in fakes:
            f.gate.set()
    for call in calls:
        list(call)
    wait_for(lambda: registry.held("fake-ep") == {}, timeout_s=5)


def capacity(router: ServerProcess, token: str | None = None) -> dict:
    """The router's /capacity; with the operators' metrics token when given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://127.0.0.1:{router.metrics_port}/capacity", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as reply:
        return json.load(reply)


def cluster_capacity(router: ServerProcess, tenant: str) -> dict:
    """ClusterStateService as the tenant's bearer token sees it."""
    with channel(router.address, "router", tenant=tenant) as ch:
        return capacity_json(cluster_pb2_grpc.ClusterStateServiceStub(ch).GetClusterCapacity(
            cluster_pb2.GetClusterCapacityRequest(), timeout=10))


def leases(data: dict, endpoint_id: str) -> dict[str, int]:
    """tenant -> guaranteed slots in one endpoint's per-tenant lease entries."""
    ep = next(e for e in data["endpoints"] if e["id"] == endpoint_id)
    return {t["tenant"]: t["guaranteed"] for t in ep.get("tenants", [])}


def test_capacity_json_carries_what_cluster_state_does(cluster, fakes, redis_server):
    """The same pools, endpoints and decisions over HTTP and gRPC. Per-tenant lease entries: all of them
    for an operator holding the metrics token (a router started with one), none over HTTP without it
    (and then its /capacity refuses a caller without the token), and over gRPC a tenant's own alone."""
    router = cluster["routers"][0]
    wait_for_model(router, "fake-model")
    as_dict = cluster_capacity(router, "alpha")
    data = capacity(router)

    def summary(pools, endpoints, decisions):
        return ({p["model"]: sorted(t["id"] for t in p["targets"]) for p in pools},
                sorted(e["id"] for e in endpoints), sorted((d["model"], d["plan"], d["reason"]) for d in decisions))

    assert summary(data["pools"], data["endpoints"], data["decisions"]) == summary(
        as_dict["pools"], as_dict["endpoints"], as_dict["decisions"])
    pool = next(p for p in data["pools"] if p["model"] == "fake-model")
    assert pool["capacity"] == 32 and pool["predicted_speedup_draft"] == pytest.approx(1.5)
    ep = next(e for e in data["endpoints"] if e["id"] == "fake-ep")
    assert ep["max_sessions"] == 4
    real = next(e for e in data["endpoints"] if e["id"] == "spec-1")
    assert real["models"] == [cluster["model"]] and real["max_sessions"] == 16
    assert data["registry_reachable"] is True

    # Who shares the pool, and how much of it, is for operators and for each tenant about itself.
    assert leases(data, "fake-ep") == {} and leases(data, "spec-1") == {}, "no metrics token: no tenant's leases"
    assert leases(as_dict, "fake-ep") == {"alpha": 2}
    assert leases(cluster_capacity(router, "beta"), "fake-ep") == {"beta": 2}
    assert leases(cluster_capacity(router, "tester"), "fake-ep") == {}, "an unweighted tenant sees nobody's"
    operators = start_router("router-ops", redis_server.url, env={METRICS_TOKEN_ENV: "operators-metrics-token"})
    try:
        full = wait_for(lambda: (c := capacity(operators, "operators-metrics-token"))["endpoints"]
                        and any(p["model"] == "fake-model" for p in c["pools"]) and c)
        assert leases(full, "fake-ep") == {"alpha": 2, "beta": 2}
        assert summary(full["pools"], full["endpoints"], [])[:2] == summary(data["pools"], data["endpoints"], [])[:2]
        with pytest.raises(urllib.error.HTTPError) as refused:
            capacity(operators)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as refused:
            capacity(operators, "a-wrong-token")
        assert refused.value.code == 401
    finally:
        operators.stop()


# Issue 38.1, as a compromised member does it: `specpool up` gives every member a Redis user of its own
# that may write only its own record (member_acl; cluster/launcher.py _registry_url), so what one member
# can poison is its own record. The target member of tenant "mallory" writes these under its tenant's keys:
# a number that overflows a float (the original attack), nan, a negative count, an id or a tenant not its
# key's, a missing id; the endpoint member "bad-ep" writes an infinite capacity into its own record.
MALLORY = "mallory"
POISON_TARGETS = {
    "specpool:target:mallory:10.9.9.9:1": {"id": "10.9.9.9:1", "address": "10.9.9.9:1", "model": "{model}",
                                           "tenant": MALLORY, "max_batch": "1e999"},
    "specpool:target:mallory:10.9.9.9:2": {"id": "10.9.9.9:2", "address": "10.9.9.9:2", "model": "{model}",
                                           "tenant": MALLORY, "mean_accept_len": "nan", "max_batch": "8"},
    "specpool:target:mallory:10.9.9.9:3": {"id": "10.9.9.9:3", "address": "10.9.9.9:3", "model": "{model}",
                                           "tenant": MALLORY, "running": "-4"},
    "specpool:target:mallory:10.9.9.9:4": {"id": "10.9.9.9:1", "address": "10.9.9.9:4", "model": "{model}",
                                           "tenant": MALLORY},
    "specpool:target:mallory:10.9.9.9:5": {"address": "10.9.9.9:5", "model": "{model}", "tenant": MALLORY},
    "specpool:target:mallory:10.9.9.9:6": {"id": "10.9.9.9:6", "address": "10.9.9.9:6", "model": "{model}",
                                           "tenant": "target-1"},
}
POISON_ENDPOINT = {"specpool:endpoint:bad-ep": {"id": "bad-ep", "address": "10.9.9.9:6", "max_sessions": "inf",
                                                "models": "{model}"}}
# A key of another type takes a command no member's user has (SET): only the password holder can write it.
NOT_A_HASH = "specpool:target:mallory:10.9.9.9:7"


def capacity_status(router: ServerProcess) -> tuple[int, dict | str]:
    """/capacity's HTTP status and its JSON (or the error body): a 500 is an answer here, not an exception."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity", timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:200]


def capacity_read_after(router: ServerProcess, since: float) -> tuple[int, dict | str]:
    """/capacity's first answer that comes from a registry read made after `since` (time.monotonic(), the
    router's clock on this same machine), or its first error. The router reads when asked, at most every
    0.25 s, and serves the snapshot before in between (after a failed read too): only a fresh read shows
    what it makes of the registry now. Bounded: 10 s."""
    def answer():
        asked = time.monotonic()
        status, data = capacity_status(router)
        # An error, Redis taken for away (it was not before), or a snapshot read after `since`, whatever the latency.
        fresh = status != 200 or not data["registry_reachable"] or data["snapshot_age_s"] < asked - since
        return fresh and (status, data)
    return wait_for(answer, timeout_s=10)


def test_a_poisoned_registry_record_is_dropped_and_routing_goes_on(cluster, redis_server):
    """Issue 38.1: one record whose max_batch read as '1e999' left 1 request in 20 succeeding (the rest
    UNKNOWN) and /capacity answering 500. Written by the members themselves, each through its own Redis
    user into its own record, bad records are left out and counted and other tenants' requests keep
    succeeding; so does a key of another type (which only the password can write)."""
    router, model = cluster["routers"][0], cluster["model"]
    target_member = redis.Redis.from_url(redis_server.add_user(
        f"target-{MALLORY}", member_acl(PREFIX, "target", MALLORY)), decode_responses=True, socket_timeout=5)
    endpoint_member = redis.Redis.from_url(redis_server.add_user(
        "endpoint-bad-ep", member_acl(PREFIX, "endpoint", "bad-ep")), decode_responses=True, socket_timeout=5)
    admin = redis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=5)
    dropped_before = {kind: router.metric_total("specpool_router_registry_records_dropped_total", kind=kind)
                      for kind in ("target", "endpoint")}

    def dropped(kind: str) -> float:
        return router.metric_total("specpool_router_registry_records_dropped_total", kind=kind) - dropped_before[kind]

    def logged_dropped(key: str) -> bool:  # the router logs each bad record once, when it first reads it
        return f"dropped the record '{key.removeprefix(PREFIX + ':')}'" in router.logs()

    try:
        # These users are a member's, not an admin's: another tenant's or member's record is refused.
        with pytest.raises(redis.exceptions.NoPermissionError):
            target_member.hset("specpool:target:target-1:10.9.9.9:1", "max_batch", "1e999")
        with pytest.raises(redis.exceptions.NoPermissionError):
            endpoint_member.hset("specpool:endpoint:spec-1", "max_sessions", "inf")
        for member, poison in ((target_member, POISON_TARGETS), (endpoint_member, POISON_ENDPOINT)):
            for key, fields in poison.items():
                member.hset(key, mapping={k: v.format(model=model) for k, v in fields.items()})

        # Without the fix, every read that meets '1e999' raises: /capacity answers 500, Generate UNKNOWN.
        first_status, first = capacity_read_after(router, time.monotonic())
        failed = []
        for i in range(20):
            try:
                result = generate_result(stub(router, "alpha"), request(model, f"after-poison-{i}", max_tokens=2),
                                         timeout=30)
                assert len(result.completions[0].token_ids) == 2
            except grpc.RpcError as e:
                failed.append(f"{e.code().name}: {e.details()[:120]}")
        status, data = capacity_read_after(router, time.monotonic())
        assert (first_status, failed, status) == (200, [], 200), (
            f"/capacity answered {first_status} and then {status}; {len(failed)} of 20 requests failed",
            Counter(failed), first if first_status != 200 else data)
        assert data["registry_reachable"] is True
        listed = [t["id"] for p in data["pools"] for t in p["targets"]] + [e["id"] for e in data["endpoints"]]
        assert not [x for x in listed if x.startswith("10.9.9.9") or x == "bad-ep"], listed
        assert all(logged_dropped(key) for key in [*POISON_TARGETS, *POISON_ENDPOINT]), router.logs()[-3000:]
        assert dropped("target") >= len(POISON_TARGETS) and dropped("endpoint") >= 1, "each is counted"
        assert "dropped the record 'target:mallory:10.9.9.9:1': max_batch: not a number" in router.logs()
        assert router.logs().count("dropped the record 'target:mallory:10.9.9.9:1'") == 1, "one line per member"

        with pytest.raises(redis.exceptions.NoPermissionError):
            target_member.set(NOT_A_HASH, "not a hash")
        admin.set(NOT_A_HASH, "not a hash")
        status, data = capacity_read_after(router, time.monotonic())
        assert status == 200 and data["registry_reachable"] is True, \
            ("a key of another type once made every read look like an outage", status, data)
        assert logged_dropped(NOT_A_HASH), router.logs()[-3000:]
        generate_result(stub(router, "alpha"), request(model, "after-not-a-hash", max_tokens=2), timeout=30)
    finally:
        admin.delete(*POISON_TARGETS, *POISON_ENDPOINT, NOT_A_HASH)
        for client in (target_member, endpoint_member, admin):
            client.close()


# -- leases and a Redis restart, against real tiny targets ----------------------------------------------


def test_no_slot_leaks_after_200_completed_cancelled_and_abandoned_requests(cluster):
    model, registry = cluster["model"], cluster["registry"]
    routers = cluster["routers"]
    for r in routers:
        wait_for_model(r, model)
    before = [t.metric_total("specpool_target_requests_total") for t in cluster["targets"]]

    def run(i: int) -> str:
        who = "alpha" if i % 3 else "beta"
        s = stub(routers[i % 2], who)
        kind = ("unary", "stream", "stream", "cancel", "disconnect")[i % 5]
        rid = f"leak-{i}"
        if kind == "unary":
            result = generate_result(s, request(model, rid, DRAFT, max_tokens=6), timeout=60)
            assert len(result.completions[0].token_ids) == 6
            return kind
        call = s.Generate(request(model, rid, DRAFT, max_tokens=6 if kind == "stream" else 100), timeout=60)
        if kind == "stream":
            tokens = [t for m in call if m.HasField("delta") for t in m.delta.token_ids]
            assert len(tokens) == 6
            return kind
        next(call)  # running on a replica
        if kind == "cancel":
            try:  # through the other router, as the same tenant (request ids are the tenant's own)
                stub(routers[(i + 1) % 2], who).Cancel(pb.CancelRequest(request_id=rid), timeout=10)
                found = True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
                found = False  # it finished first
            finals = [m.final for m in call if m.HasField("final")]
            assert len(finals) == 1
            reason = finish_reason_name(finals[0].completions[0].finish_reason)
            assert found or reason == "length", (rid, reason)
            return reason
        call.cancel()  # the client goes away mid-stream
        return kind

    with ThreadPoolExecutor(6) as pool:
        outcomes = Counter(pool.map(run, range(200)))
    assert outcomes["unary"] == 40 and outcomes["stream"] == 80 and outcomes["disconnect"] == 40
    assert outcomes["cancelled"] + outcomes["length"] == 40 and outcomes["cancelled"] > 0, outcomes
    wait_for(lambda: registry.held("spec-1") == {}, timeout_s=10)
    for r in routers:
        wait_for(lambda r=r: r.metric_total("specpool_router_draft_leases_held") == 0, timeout_s=5)
        assert r.metric_total("specpool_router_decisions_total", model=model, plan="draft_model") > 0
        assert r.metric_total("specpool_router_requests_total", model=model, outcome="cancelled") > 0
    served = [t.metric_total("specpool_target_requests_total") - b for t, b in zip(cluster["targets"], before)]
    assert min(served) >= 40, f"both replicas take work: {served}"


def test_a_redis_restart_loses_no_in_flight_request_and_the_registry_rebuilds(cluster):
    model, registry, redis_server = cluster["model"], cluster["registry"], cluster["redis"]
    router = cluster["routers"][0]
    wait_for_model(router, model)
    s = stub(router)
    restarted = threading.Event()

    def stream(i: int) -> list[int]:
        call = stub(router, "alpha").Generate(request(model, f"restart-{i}", DRAFT, max_tokens=100), timeout=60)
        tokens = []
        for m in call:
            if m.HasField("delta"):
                tokens.extend(m.delta.token_ids)
                restarted.wait(30)
            else:
                assert list(m.final.completions[0].token_ids) == tokens
        return tokens

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(stream, i) for i in range(6)]
        wait_for(lambda: sum(t.metric_total("specpool_target_running_sequences") for t in cluster["targets"]) > 0)
        redis_server.stop()
        try:
            # While Redis is down the router places on its last snapshot, without draft slots.
            during = generate_result(s, request(model, "during-outage", DRAFT, max_tokens=5), timeout=30)
            assert len(during.completions[0].token_ids) == 5
        finally:
            redis_server.start()
            restarted.set()
        assert [len(f.result()) for f in running] == [100] * 6
    assert router.metric_total("specpool_router_decisions_total", model=model, reason="registry_unavailable") >= 1

    def rebuilt():
        return (sorted(t.tenant for t in registry.targets() if t.model == model) == ["target-1", "target-2"]
                and "spec-1" in [e.id for e in registry.endpoints()])
    wait_for(rebuilt, timeout_s=5)
    wait_for_model(router, model)  # the router's snapshot follows the registry within its 0.25 s re-read
    after = generate_result(s, request(model, "after-restart", DRAFT, max_tokens=5), timeout=30)
    assert len(after.completions[0].token_ids) == 5
    wait_for(lambda: router.metric_total("specpool_router_decisions_total", model=model, plan="draft_model",
                            reason="requested") > 0)
    wait_for(lambda: registry.held("spec-1") == {}, timeout_s=10)
