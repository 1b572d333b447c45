"""What a router replica keeps between registry reads, against a real Redis that goes away and comes back:

- its snapshot: re-read at most every max_age_s, kept through an outage, and kept through the moment
  a restarted, empty Redis is being refilled by heartbeats;
- its leases: renewed while their requests run, taken again after a restart lost them, released once.
"""

from __future__ import annotations

import time

import pytest

from specpool.cluster.redis_server import start_redis
from specpool.common.registry import Heartbeat, Registry
from specpool.router.leases import LeaseKeeper
from specpool.router.view import ClusterView, DirectChecks


@pytest.fixture
def redis_server():
    server = start_redis()
    yield server
    server.close()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(url: str, member_id: str, model: str = "m") -> Heartbeat:
    """One synchronous beat (no thread): enough for a snapshot to see the member."""
    heartbeat = Heartbeat(url, "target", member_id, lambda: {"address": f"{member_id}:1", "model": model, "max_batch": 4},
                          ttl_s=60.0)
    assert heartbeat.beat()
    return heartbeat


def test_the_snapshot_is_cached_and_survives_an_outage_checked_directly(redis_server):
    """While Redis is down the members read before stay in use for as long as they answer health checks
    of their own (here a fake check; the router's asks grpc.health.v1), however long the outage."""
    registry, clock = Registry(redis_server.url), Clock()
    errors = []
    answering = {"t1:1": True, "t2:1": True}  # by address
    checks = DirectChecks(lambda addresses: [answering[a] for a in addresses], interval_s=3600, misses=2)
    view = ClusterView(registry, max_age_s=0.25, checks=checks, clock=clock, on_error=lambda: errors.append(1))
    beat(redis_server.url, "t1")
    assert [t.id for t in view.snapshot().targets] == ["t1"]
    beat(redis_server.url, "t2")
    assert [t.id for t in view.snapshot().targets] == ["t1"], "cached for max_age_s"
    clock.now += 0.3
    assert [t.id for t in view.snapshot().targets] == ["t1", "t2"]

    redis_server.stop()
    clock.now += 0.3
    stale = view.snapshot()
    assert not stale.reachable and [t.id for t in stale.targets] == ["t1", "t2"] and errors
    answering["t2:1"] = False
    for _ in range(checks.misses):  # what the checking thread does every interval_s (an hour here)
        checks.check_once()
    clock.now += 3600
    assert [t.id for t in view.snapshot().targets] == ["t1"], "an hour on: t1 still answers, t2 does not"
    answering["t2:1"] = True
    checks.check_once()
    clock.now += 0.3
    assert [t.id for t in view.snapshot().targets] == ["t1", "t2"], "t2 answers again"

    answering["t2:1"] = False
    for _ in range(checks.misses):
        checks.check_once()
    redis_server.start()  # empty: no persistence
    clock.now += 0.3
    rebuilding = view.snapshot()
    assert rebuilding.reachable and [t.id for t in rebuilding.targets] == ["t1"], \
        "kept, less the member found down, while heartbeats refill Redis"
    clock.now += 5
    assert view.snapshot().targets == [], "nothing beat: gone for real after the grace"
    checks.close()
    registry.close()


def test_an_empty_registry_right_after_a_full_one_is_taken_for_a_rebuild(redis_server):
    registry, clock = Registry(redis_server.url), Clock()
    view = ClusterView(registry, max_age_s=0.0, rebuild_grace_s=5.0, clock=clock)
    beat(redis_server.url, "t1")
    assert len(view.snapshot().targets) == 1
    redis_server.restart()
    clock.now += 1
    assert [t.id for t in view.snapshot().targets] == ["t1"], "kept while heartbeats refill Redis"
    clock.now += 5
    assert view.snapshot().targets == [], "gone for real after the grace"
    beat(redis_server.url, "t3")
    assert [t.id for t in view.snapshot().targets] == ["t3"]
    registry.close()


def test_leases_are_renewed_retaken_after_a_restart_and_released_once(redis_server):
    registry = Registry(redis_server.url)
    errors = []
    keeper = LeaseKeeper(registry, {"alpha": 1.0, "beta": 1.0}, ttl_s=0.3, renew_s=3600, on_error=errors.append)
    lease = keeper.acquire("ep", "alpha", 4, "req-1")
    assert lease is not None and keeper.held() == 1
    time.sleep(0.2)
    keeper.renew_all()
    time.sleep(0.2)
    assert registry.held("ep") == {"alpha": 1}, "renewed past its first TTL"

    redis_server.restart()
    assert registry.held("ep") == {}
    keeper.renew_all()
    assert registry.held("ep") == {"alpha": 1}, "taken again"

    redis_server.stop()
    keeper.release(lease)  # logged, not raised; the lease would expire by its TTL
    assert errors == ["release"] and keeper.held() == 0
    redis_server.start()
    keeper.release(lease)
    assert keeper.held() == 0
    assert keeper.acquire("ep", "gamma", 4, "req-2") is None, "unweighted: all 4 slots are reserved"
    registry.close()


def test_flags():
    from specpool.cli import build_parser
    from specpool.router.server import parse_tenant_weights

    assert parse_tenant_weights("alpha=1, beta=2.5") == {"alpha": 1.0, "beta": 2.5}
    assert parse_tenant_weights("") == {}
    for bad in ("alpha", "alpha=0", "alpha=-1", "=1", "alpha=x", "alpha=inf"):
        with pytest.raises(ValueError, match="--tenant-weights"):
            parse_tenant_weights(bad)
    parser = build_parser()
    args = parser.parse_args(["serve-router", "--redis", "redis://h:1/0"])
    assert (args.port, args.lease_ttl_s, args.tenant_weights) == (50070, 10.0, "")
    for command in ("serve-target", "serve-spec"):
        args = parser.parse_args([command])
        assert (args.redis, args.advertise_host) == (None, "127.0.0.1")


def test_a_slot_is_leased_for_the_callers_tenant_else_the_targets(redis_server):
    from specpool.router.metrics import RouterMetrics
    from specpool.router.routing import Router, RouterConfig, RoutingError, tenant_of
    from specpool_client.v1 import target_pb2 as pb

    url = redis_server.url
    Heartbeat(url, "endpoint", "ep", lambda: {"address": "h:9", "models": ["m"], "max_sessions": 4}).beat()
    Heartbeat(url, "target", "h:1", lambda: {"address": "h:1", "model": "m", "tenant": "alpha", "max_batch": 4,
                                             "spec_endpoint": "h:9", "predicted_speedup_draft": 1.5,
                                             "predicted_speedup_ngram": 1.2}).beat()
    registry = Registry(url)
    shares = {"alpha": 1.0, "beta": 1.0}
    router = Router(ClusterView(registry), LeaseKeeper(registry, shares, ttl_s=60), RouterMetrics(),
                    RouterConfig(tenant_weights=shares))
    request = pb.GenerateRequest(model="m", prompt="x", max_tokens=1)
    assert tenant_of([("x-specpool-tenant", " beta ")]) == "beta" and tenant_of([]) is None
    routes = [router.route(request, None), router.route(request, "beta"), router.route(request, None)]
    assert [(r.tenant, r.decision.method) for r in routes] == [("alpha", "draft_model"), ("beta", "draft_model"),
                                                             ("alpha", "draft_model")]
    assert registry.held("ep") == {"alpha": 2, "beta": 1}
    third = router.route(request, None)
    assert (third.decision.method, third.decision.reason, third.lease) == ("ngram", "no_slot", None)
    for r in routes + [third]:
        router.finish(r, "ok")
    assert registry.held("ep") == {} and router.leases.held() == 0
    assert routes[0].request.speculation.method == pb.SPECULATION_METHOD_DRAFT_MODEL
    assert third.request.speculation.method == pb.SPECULATION_METHOD_NGRAM and third.request.request_id
    unknown = pb.GenerateRequest(model="m", prompt="x", max_tokens=1)
    unknown.speculation.method = 99  # proto3 enums take any number
    with pytest.raises(RoutingError, match=r"^speculation.method: unknown \w+ 99; one of SPECULATION_METHOD_UNSPECIFIED"):
        router.route(unknown, None)
    registry.close()
