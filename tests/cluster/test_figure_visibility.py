"""Whose per-tenant figures each caller reads, on every surface that lists them (issue 38, point 2).

One set of real processes for the module: Redis, serve-spec (a tiny n-gram-only model) and
serve-router, both with an operator's metrics token. Two tenants hold figures there: alpha one
endpoint session and one router lease, beta two of each. Each surface is then read as each role:

- gRPC: the endpoint's GetCapacity and the router's GetClusterCapacity. An operator's certificate
  (operator/<name>) and the services' own see every tenant's; a tenant's client certificate
  (client/<tenant>, what `specpool up` hands each tenant), its bearer token and a target's
  certificate see their own tenant's alone.
- HTTP: /capacity and /metrics on both servers. Per-tenant labelled, they answer only the
  operator's metrics token: a tenant has none, and its router token is no substitute.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.common.registry import Registry
from specpool.common.security import ANONYMOUS, Security
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import save_gguf
from specpool.engine.runtime.model import random_weights
from specpool.router.capacity import capacity_json
from specpool_client.v1 import cluster_pb2, cluster_pb2_grpc, speculation_pb2_grpc
from specpool_client.v1 import speculation_pb2 as spb
from tests.pki import CA

MODEL, ENDPOINT_ID = "tiny", "spec"
METRICS_TOKEN = "operators-metrics-token-for-these-tests"
FIGURES = {"alpha": 1, "beta": 2}  # each tenant's open endpoint sessions, and its router leases
EVERY = set(FIGURES)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Redis, an endpoint and a router (each with the metrics token), and the tenants' figures on them."""
    cfg = tiny_config(vocab_size=64, d_model=16)
    gguf = save_gguf(tmp_path_factory.mktemp("visibility") / "tiny.gguf", cfg, random_weights(cfg, seed=5))
    redis_server = start_redis()
    env = {"SPECPOOL_REDIS_URL": redis_server.url, METRICS_TOKEN_ENV: METRICS_TOKEN}
    started: list[ServerProcess] = []
    registry = Registry(redis_server.url)
    try:
        with ThreadPoolExecutor(2) as pool:
            endpoint = pool.submit(start_server, "spec-visibility", [
                "serve-spec", "--port", "0", "--metrics-port", "0", "--drafter", f"{MODEL}={gguf}",
                "--endpoint-id", ENDPOINT_ID, "--max-sessions", "8", "--threads", "1",
                "--lease-s", "600", "--max-lease-s", "600"], env=env)
            router = pool.submit(start_server, "router-visibility", [
                "serve-router", "--port", "0", "--metrics-port", "0", "--tenant-weights", "alpha=1,beta=1"], env=env)
            started += [endpoint.result(), router.result()]
        endpoint, router = started
        for tenant, count in FIGURES.items():  # sessions as each tenant's target opens them
            with Security.load(CA.dir, "target", tenant).channel(endpoint.address, "endpoint") as channel:
                opened = speculation_pb2_grpc.SpeculationServiceStub(channel).OpenSessions(spb.OpenSessionsRequest(
                    tenant=tenant, target_model=MODEL, sessions=[
                        spb.SessionSpec(request_id=f"{tenant}-{i}", context=[1, 2, 3],
                                        drafter=spb.DRAFTER_KIND_NGRAM) for i in range(count)]), timeout=30)
            assert all(s.ok for s in opened.sessions), opened
            for i in range(count):  # draft slots as a router leases them, for the module's length
                assert registry.acquire(ENDPOINT_ID, tenant, f"{tenant}-lease-{i}", 8, {}, ttl_s=600)
        # The router reads the registry on its own period: wait until its view holds the leases.
        wait_for(lambda: http_capacity(router, METRICS_TOKEN)[1] == FIGURES, timeout_s=20)
        yield {"endpoint": endpoint, "router": router}
    finally:
        for server in started:
            server.stop()
        registry.close()
        redis_server.close()


# -- the surfaces: each returns tenant -> figure, as the caller sees it -----------------------------------


def grpc_capacity(surface: str, server: ServerProcess, caller: Security) -> dict[str, int]:
    """The endpoint's GetCapacity (open sessions) or the router's GetClusterCapacity (leased slots)."""
    if surface == "endpoint":
        with caller.channel(server.address, "endpoint", ENDPOINT_ID) as channel:
            report = speculation_pb2_grpc.SpeculationServiceStub(channel).GetCapacity(
                spb.GetCapacityRequest(), timeout=10)
        return {t.tenant: t.active_sessions for t in report.tenants}
    with caller.channel(server.address, "router") as channel:
        report = cluster_pb2_grpc.ClusterStateServiceStub(channel).GetClusterCapacity(
            cluster_pb2.GetClusterCapacityRequest(), timeout=10)
    return leased(capacity_json(report))


def leased(capacity: dict) -> dict[str, int]:
    [endpoint] = [e for e in capacity["endpoints"] if e["id"] == ENDPOINT_ID]
    return {t["tenant"]: int(t["leased"]) for t in endpoint["tenants"] if int(t["leased"])}


def http_get(server: ServerProcess, path: str, bearer: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    request = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_capacity(server: ServerProcess, bearer: str | None) -> tuple[int, dict[str, int]]:
    status, body = http_get(server, "/capacity", bearer)
    if status != 200:
        return status, {}
    report = json.loads(body)
    if "endpoints" in report:  # a router's
        return status, leased(report)
    return status, {t["tenant"]: int(t["activeSessions"]) for t in report.get("tenants", [])}


def http_metrics(server: ServerProcess, bearer: str | None) -> tuple[int, set[str]]:
    """The tenants /metrics names in its labels."""
    status, body = http_get(server, "/metrics", bearer)
    return status, set(re.findall(r'tenant="([^"]*)"', body.decode())) if status == 200 else set()


# -- the roles ----------------------------------------------------------------------------------------


def token_only(tenant: str) -> Security:
    """A tenant's program with its router bearer token and no certificate at all."""
    return Security(ca=CA.cert_pem, cert=None, key=None, identity=ANONYMOUS,
                    token=CA.token(tenant))


CALLERS = {
    "operator certificate": lambda: CA.operator("ops"),
    "router certificate": lambda: Security.load(CA.dir, "router", "router"),
    "alpha's target certificate": lambda: Security.load(CA.dir, "target", "alpha"),
    "alpha's client certificate and token": lambda: CA.client("alpha", "alpha"),
    "beta's client certificate and token": lambda: CA.client("beta", "beta"),
    "gamma's client certificate and token": lambda: CA.client("gamma", "gamma"),  # a tenant with no figures
    "alpha's token alone": lambda: token_only("alpha"),
}
REFUSED = None
GRPC_CASES = [  # surface, caller, whose figures it reads
    ("endpoint", "operator certificate", EVERY),
    ("endpoint", "router certificate", EVERY),
    ("endpoint", "alpha's target certificate", {"alpha"}),
    ("endpoint", "alpha's client certificate and token", {"alpha"}),  # read every tenant's before
    ("endpoint", "beta's client certificate and token", {"beta"}),
    ("endpoint", "gamma's client certificate and token", set()),
    # The router's port asks for no certificate (tenants' programs hold tokens): there the token
    # names the caller, and an operator reads the router's figures from /capacity with the metrics token.
    ("router", "alpha's client certificate and token", {"alpha"}),
    ("router", "beta's client certificate and token", {"beta"}),
    ("router", "gamma's client certificate and token", set()),
    ("router", "alpha's token alone", {"alpha"}),
    ("router", "operator certificate", REFUSED),
]


@pytest.mark.parametrize("surface, caller, visible", GRPC_CASES, ids=[f"{s}, {c}" for s, c, _ in GRPC_CASES])
def test_grpc_capacity_shows_each_caller_the_tenants_its_role_may_see(servers, surface, caller, visible):
    if visible is REFUSED:
        with pytest.raises(grpc.RpcError) as refused:
            grpc_capacity(surface, servers[surface], CALLERS[caller]())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        return
    assert grpc_capacity(surface, servers[surface], CALLERS[caller]()) == {t: FIGURES[t] for t in visible}


HTTP_ROLES = {  # bearer token presented -> whether it opens the per-tenant routes
    "the operator's metrics token": (lambda: METRICS_TOKEN, True),
    "alpha's router token": (lambda: CA.token("alpha"), False),
    "no token": (lambda: None, False),
}
HTTP_CASES = [(surface, route, role) for surface in ("endpoint", "router") for route in ("/capacity", "/metrics")
              for role in HTTP_ROLES]


@pytest.mark.parametrize("surface, route, role", HTTP_CASES, ids=[f"{s} {p}, {r}" for s, p, r in HTTP_CASES])
def test_http_per_tenant_routes_answer_only_the_operators_metrics_token(servers, surface, route, role):
    bearer, operator = HTTP_ROLES[role]
    server = servers[surface]
    if route == "/capacity":
        status, seen = http_capacity(server, bearer())
        expected = FIGURES
    else:
        status, seen = http_metrics(server, bearer())
        expected = EVERY
    if operator:
        assert (status, seen) == (200, expected)
    else:
        assert (status, seen) == (401, type(expected)()), "a tenant has no metrics token"
