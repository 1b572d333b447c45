# Over 400 lines: the registry's promises (records, ACLs, leases) against one real redis-server module fixture.
"""The Redis registry against a real redis-server: heartbeats with TTLs, and draft-slot leases.

- a member appears with its fields, drops out when it stops beating (TTL), and at once when it
  deregisters; its heartbeat outlives a Redis restart and registers it again;
- leases: each tenant keeps floor(capacity * w / sum w) slots a greedy tenant cannot take, even
  with many routers acquiring at once; unweighted tenants only borrow unreserved slots; expired
  leases free their slot; release and renew;
- the target's predicted speedup from its policy, and the endpoint's heartbeat fields.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from specpool.cluster.processes import start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.errors import FieldError
from specpool.common.registry import Heartbeat, Registry, redacted
from specpool.common.registry_leases import guarantees
from specpool.common.registry_schema import (
    EndpointRegistration,
    TargetRegistration,
    decode_record,
    encode_fields,
    member_acl,
)
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts
from specpool.engine.policy.draft_length import SpeculationPolicy
from specpool.spec_endpoint.messages import CapacityReport, ModelReport, TenantReport
from specpool.spec_endpoint.registration import heartbeat_fields
from specpool.target_service.registration import predicted_speedup


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis()
    yield server
    server.close()


@pytest.fixture
def registry(redis_server):
    reg = Registry(redis_server.url)
    reg.client.flushdb()
    yield reg
    reg.close()



def target_fields(**overrides) -> dict:
    return {"address": "127.0.0.1:7001", "model": "m", "tenant": "t1", "max_batch": 8, "running": 3, "queued": 1,
            "spec_endpoint": "127.0.0.1:7100", "mean_accept_len": 1.7, "predicted_speedup_draft": 1.4,
            "predicted_speedup_ngram": 1.1, "predicted_speedup_ssd": 0.8, "methods": ["draft_model", "ngram"],
            **overrides}


# -- heartbeats -------------------------------------------------------------------------------------


def test_a_member_registers_and_drops_out_when_it_stops_beating(registry, redis_server):
    beat = Heartbeat(redis_server.url, "target", "127.0.0.1:7001", lambda: target_fields(),
                     ttl_s=0.5, interval_s=0.1).start()
    try:
        [t] = wait_for(registry.targets)
        assert t == TargetRegistration(
            id="127.0.0.1:7001", address="127.0.0.1:7001", model="m", tenant="t1", max_batch=8, running=3,
            queued=1, spec_endpoint="127.0.0.1:7100", mean_accept_len=1.7, predicted_speedup_draft=1.4,
            predicted_speedup_ngram=1.1, predicted_speedup_ssd=0.8, methods=("draft_model", "ngram"),
            updated=t.updated)
        assert abs(t.updated - time.time()) < 2
        assert 0 < registry.client.pttl("specpool:target:t1:127.0.0.1:7001") <= 500, "keyed by tenant and id"
    finally:
        beat.stop(deregister=False)  # as if it crashed
    assert registry.targets(), "still listed until its TTL runs out"
    wait_for(lambda: not registry.targets(), timeout_s=2.0)


def test_deregistering_removes_a_member_at_once(registry, redis_server):
    beat = Heartbeat(redis_server.url, "endpoint", "ep-1", lambda: {"address": "h:1", "models": ["m"],
                                                                     "max_sessions": 4}).start()
    wait_for(registry.endpoints)
    beat.stop()
    assert registry.endpoints() == []


def test_live_fields_are_read_on_every_beat(registry, redis_server):
    load = {"running": 0}
    beat = Heartbeat(redis_server.url, "target", "t", lambda: target_fields(**load), ttl_s=1.0,
                     interval_s=0.05).start()
    try:
        wait_for(registry.targets)
        load["running"] = 5
        wait_for(lambda: registry.targets()[0].running == 5)
    finally:
        beat.stop()


def test_a_heartbeat_registers_again_after_a_redis_restart(tmp_path):
    server = start_redis()
    try:
        reg = Registry(server.url)
        beat = Heartbeat(server.url, "target", "t", lambda: target_fields(), ttl_s=1.0, interval_s=0.05).start()
        wait_for(reg.targets)
        server.stop()
        with pytest.raises(redis.RedisError):
            reg.targets()
        time.sleep(0.2)  # beats fail meanwhile, and keep trying
        server.start()  # empty (no persistence) until the next beat
        [t] = wait_for(reg.targets, timeout_s=2.0)
        assert t.id == "t"
        beat.stop()
        reg.close()
    finally:
        server.close()


def test_unknown_fields_are_ignored_and_missing_optional_ones_keep_defaults():
    record = decode_record(EndpointRegistration, {"id": "e", "address": "h:1", "future": "1", "models": "m1,m2"})
    assert record == EndpointRegistration(id="e", address="h:1", models=("m1", "m2"))
    target = decode_record(TargetRegistration, {"id": "h:2", "address": "h:2", "model": "m",
                                                "methods": "ngram,some_future_method", "max_batch": "8.0"})
    assert target.methods == ("ngram",) and target.max_batch == 8, "a newer target's method is left out, not it"
    assert encode_fields({"a": [1, 2], "b": True, "c": 0.5}) == {"a": "1,2", "b": "1", "c": "0.5"}
    by_batch = decode_record(TargetRegistration, {"id": "h:2", "address": "h:2", "model": "m",
                                                  "predicted_speedup_ngram_by_batch": "1.3,1.1,0.9"})
    assert by_batch.predicted_speedup_ngram_by_batch == (1.3, 1.1, 0.9)


GOOD_TARGET = {"id": "10.0.0.1:7001", "address": "10.0.0.1:7001", "model": "m", "max_batch": "8"}


@pytest.mark.parametrize(("field", "value"), [
    ("max_batch", "1e999"), ("max_batch", "nan"), ("max_batch", "inf"), ("max_batch", "-1"), ("max_batch", "2.5"),
    ("max_batch", "x"), ("max_batch", "9" * 5000), ("running", "-inf"), ("queued", ""),
    ("mean_accept_len", "nan"), ("mean_accept_len", "1e308"), ("predicted_speedup_draft", "-0.5"),
    ("predicted_speedup_ngram", "inf"), ("predicted_speedup_ssd", "nan"), ("updated", "1e999"),
    ("address", "10.0.0.1"), ("address", "10.0.0.1:0"), ("address", "10.0.0.1:99999"), ("address", "a b:1"),
    ("address", ""), ("spec_endpoint", "nowhere"), ("model", ""), ("model", "m" * 300), ("tenant", "t\x00"),
    ("methods", ",".join(["ngram"] * 100)), ("methods", "x" * 5000),
    ("predicted_speedup_draft_by_batch", "1.2,nan"), ("predicted_speedup_ngram_by_batch", "1.2,-1"),
    ("predicted_speedup_ssd_by_batch", ",".join(["1.1"] * 65)),
])
def test_a_target_field_out_of_range_or_malformed_is_named(field, value):
    with pytest.raises(FieldError) as error:
        decode_record(TargetRegistration, {**GOOD_TARGET, field: value})
    assert error.value.field == field


@pytest.mark.parametrize(("field", "value"), [
    ("max_sessions", "1e999"), ("active_sessions", "-1"), ("draft_busy_ratio", "1.5"), ("acceptance", "nan"),
    ("hit_ratio", "-inf"), ("models", "m\n"), ("id", ""), ("address", "[::1]"),
])
def test_an_endpoint_field_out_of_range_or_malformed_is_named(field, value):
    with pytest.raises(FieldError) as error:
        decode_record(EndpointRegistration, {"id": "e", "address": "[::1]:7100", field: value})
    assert error.value.field == field


@pytest.mark.parametrize("missing", ["id", "address", "model"])
def test_a_record_without_a_required_field_is_refused(missing):
    with pytest.raises(FieldError, match=f"^{missing}: required"):
        decode_record(TargetRegistration, {k: v for k, v in GOOD_TARGET.items() if k != missing})


def test_a_read_drops_bad_records_counts_each_and_logs_each_member_once(registry, redis_server, caplog):
    dropped: list[str] = []
    reader = Registry(redis_server.url, on_dropped=dropped.append)
    good = {**GOOD_TARGET, "id": "10.0.0.1:1", "address": "10.0.0.1:1", "tenant": "t1"}
    registry.client.hset("specpool:target:t1:10.0.0.1:1", mapping=good)
    registry.client.hset("specpool:target:t1:10.0.0.1:2", mapping={**good, "id": "10.0.0.1:2", "max_batch": "1e999"})
    registry.client.hset("specpool:target:t1:10.0.0.1:3", mapping={**good, "id": "10.0.0.1:1"})  # another's id
    registry.client.hset("specpool:target:t2:10.0.0.1:5", mapping={**good, "id": "10.0.0.1:5"})  # another's tenant
    registry.client.set("specpool:target:t1:10.0.0.1:4", "not a hash")
    registry.client.hset("specpool:endpoint:e", mapping={"id": "e", "address": "h:1", "acceptance": "nan"})
    try:
        for _ in range(2):
            assert [t.id for t in reader.targets()] == ["10.0.0.1:1"]
            assert reader.endpoints() == []
        assert dropped == (["target"] * 4 + ["endpoint"]) * 2
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert lines == [
            ("registry: dropped the record 'target:t1:10.0.0.1:2': max_batch: not a number in [0, 1.04858e+06], "
             "got '1e999'"),
            "registry: dropped the record 'target:t1:10.0.0.1:3': id: the record's id or tenant is not its key's",
            ("registry: dropped the record 'target:t1:10.0.0.1:4': record: unreadable (WRONGTYPE Operation "
             "against a key holding the wrong kind of value)"),
            "registry: dropped the record 'target:t2:10.0.0.1:5': id: the record's id or tenant is not its key's",
            "registry: dropped the record 'endpoint:e': acceptance: not a number in [0, 1], got 'nan'",
        ]
    finally:
        reader.close()


def beats(url: str, kind: str, member_id: str, fields: dict) -> bool:
    """Whether one heartbeat of the member, logged in at url, is taken."""
    heartbeat = Heartbeat(url, kind, member_id, lambda: fields)
    try:
        return heartbeat.beat()
    finally:
        heartbeat.stop(deregister=False)


def test_a_members_redis_user_writes_only_its_own_record(redis_server, registry):
    """Issue 38: every member held the one Redis password, so any could rewrite every record. A member's
    user (as `specpool up` makes them) writes its own record; a target's, any of its tenant's replicas."""
    t0 = redis_server.add_user("target-t0", member_acl("specpool", "target", "t0"))
    e1 = redis_server.add_user("endpoint-e*", member_acl("specpool", "endpoint", "e*"))
    router = redis_server.add_user("router-r", member_acl("specpool", "router"))
    endpoint = {"address": "127.0.0.1:7100", "max_sessions": 4}
    assert beats(t0, "target", "127.0.0.1:7001", target_fields(tenant="t0"))
    assert beats(t0, "target", "127.0.0.1:7002", target_fields(tenant="t0", address="127.0.0.1:7002"))
    assert not beats(t0, "target", "127.0.0.1:7003", target_fields(tenant="t1")), "another tenant's record"
    assert not beats(t0, "endpoint", "e*", endpoint), "an endpoint's record"
    assert beats(e1, "endpoint", "e*", endpoint)
    assert not beats(e1, "endpoint", "e2", endpoint), "'*' in its id is no wildcard"
    assert not beats(e1, "target", "127.0.0.1:7004", target_fields(tenant="t0")), "a target's record"
    for url in (t0, e1, router):
        with redis.Redis.from_url(url) as client:
            for command in (["FLUSHALL"], ["CONFIG", "SET", "requirepass", "x"], ["ACL", "SETUSER", "x", "on"],
                            ["EVAL", "return 1", "0"], ["SET", "specpool:target:t0:x", "1"]):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
    reader = Registry(router)
    try:
        assert sorted(t.id for t in reader.targets()) == ["127.0.0.1:7001", "127.0.0.1:7002"]
        assert [e.id for e in reader.endpoints()] == ["e*"]
        assert reader.acquire("e*", "t0", "l1", 4, {"t0": 1.0}, 60) and reader.held("e*") == {"t0": 1}
        assert reader.renew("e*", "l1", 60) and reader.release("e*", "l1")
    finally:
        reader.close()


def test_heartbeat_rejects_bad_arguments(redis_server):
    with pytest.raises(ValueError, match="kind"):
        Heartbeat(redis_server.url, "router", "x", dict)
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(redis_server.url, "target", "x", dict, ttl_s=1.0, interval_s=1.0)


# -- leases -----------------------------------------------------------------------------------------

SHARES = {"alpha": 1.0, "beta": 1.0}


def test_a_greedy_tenant_cannot_take_anothers_reserved_slots(registry):
    granted = [registry.acquire("ep", "alpha", f"a{i}", 4, SHARES, 60) for i in range(10)]
    assert granted == [True, True, False, False, False, False, False, False, False, False]
    assert [registry.acquire("ep", "beta", f"b{i}", 4, SHARES, 60) for i in range(3)] == [True, True, False]
    assert registry.held("ep") == {"alpha": 2, "beta": 2}


def test_a_tenant_borrows_only_unreserved_slots(registry):
    shares = {"alpha": 1.0, "beta": 1.0}
    # capacity 5: 2 + 2 guaranteed, 1 free for anyone.
    assert [registry.acquire("ep", "alpha", f"a{i}", 5, shares, 60) for i in range(4)] == [True, True, True, False]
    assert registry.acquire("ep", "gamma", "g0", 5, shares, 60) is False, "unweighted: only unreserved slots"
    assert [registry.acquire("ep", "beta", f"b{i}", 5, shares, 60) for i in range(3)] == [True, True, False]
    registry.release("ep", "a2")  # the borrowed slot comes back to the unreserved pool
    assert registry.acquire("ep", "gamma", "g0", 5, shares, 60) is True


def test_weights_set_the_guarantees(registry):
    shares = {"alpha": 3.0, "beta": 1.0}
    assert guarantees(8, shares) == {"alpha": 6, "beta": 2}
    assert sum(registry.acquire("ep", "beta", f"b{i}", 8, shares, 60) for i in range(8)) == 2
    assert sum(registry.acquire("ep", "alpha", f"a{i}", 8, shares, 60) for i in range(8)) == 6


def test_without_weights_slots_are_first_come_first_served(registry):
    assert sum(registry.acquire("ep", "alpha", f"a{i}", 3, {}, 60) for i in range(5)) == 3
    assert registry.acquire("ep", "beta", "b0", 3, {}, 60) is False


def test_shares_hold_under_contention_from_many_routers(registry, redis_server):
    """Eight clients (as eight router replicas) race for 12 slots: 16 alpha and 16 beta attempts."""
    clients = [Registry(redis_server.url) for _ in range(8)]
    barrier = threading.Barrier(8)

    def race(i: int) -> list[tuple[str, bool]]:
        barrier.wait()
        out = []
        for j in range(4):
            tenant = "alpha" if (i + j) % 2 else "beta"
            out.append((tenant, clients[i].acquire("ep", tenant, f"{tenant}-{i}-{j}", 12, SHARES, 60)))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(race, range(8)) for r in rs]
    for c in clients:
        c.close()
    won = {t: sum(ok for tenant, ok in results if tenant == t) for t in SHARES}
    assert won == {"alpha": 6, "beta": 6}
    assert registry.held("ep") == {"alpha": 6, "beta": 6}


def test_expired_leases_free_their_slots(registry):
    assert registry.acquire("ep", "alpha", "short", 1, {}, 0.1)
    assert registry.acquire("ep", "beta", "b", 1, {}, 60) is False
    time.sleep(0.15)
    assert registry.acquire("ep", "beta", "b", 1, {}, 60)
    assert registry.held("ep") == {"beta": 1}


def test_release_and_renew(registry):
    assert registry.acquire("ep", "alpha", "x", 2, SHARES, 0.2)
    assert registry.acquire("ep", "alpha", "x", 2, SHARES, 0.2), "re-acquiring a held lease renews it"
    assert registry.held("ep") == {"alpha": 1}
    assert registry.renew("ep", "x", 60)
    time.sleep(0.25)
    assert registry.held("ep") == {"alpha": 1}, "renewed past its first TTL"
    assert registry.release("ep", "x") is True
    assert registry.release("ep", "x") is False
    assert registry.renew("ep", "x", 60) is False
    assert registry.held("ep") == {}


def test_lease_arguments_are_checked(registry):
    with pytest.raises(ValueError, match="weights"):
        registry.acquire("ep", "alpha", "x", 2, {"alpha": 0.0}, 1)
    with pytest.raises(ValueError, match="ttl_s"):
        registry.acquire("ep", "alpha", "x", 2, {}, 0)


# -- what services publish --------------------------------------------------------------------------


def costs(per_token: float) -> StepCosts:
    """T(b, s) = 10 ms + per_token * b * (s + 1)."""
    bs, lens = (1, 2, 4, 8, 16), (0, 1, 2, 4, 8)
    return StepCosts(bs, lens, tuple(tuple(0.010 + per_token * b * (s + 1) for s in lens) for b in bs))


def test_predicted_speedup_follows_the_policy():
    cheap = SpeculationPolicy(costs(0.0001), max_draft=8)
    high, low = AcceptanceEstimate(prior_alpha=0.8), AcceptanceEstimate(prior_alpha=0.3)
    assert predicted_speedup(cheap, 1, high) > 2.0, "memory-bound: drafts are nearly free"
    expensive = SpeculationPolicy(costs(0.01), max_draft=8)
    assert predicted_speedup(expensive, 16, low) < 1.0, "compute-bound: every draft costs a full token"
    assert predicted_speedup(cheap, 16, high) < predicted_speedup(cheap, 1, high)
    assert predicted_speedup(None, 4, low) == 1.0


def test_routers_are_told_the_estimate_the_policy_chooses_by():
    """The heartbeat's figure is the policy's own: once real speculative rounds measure slower than the
    table predicts, the policy stops buying drafts and routers are told it would lose."""
    policy = SpeculationPolicy(costs(0.0001), max_draft=8, min_gain=1.0)
    acceptance = AcceptanceEstimate(prior_alpha=0.8)
    assert predicted_speedup(policy, 1, acceptance) > 2.0 and policy.choose(1, acceptance.expected_tokens) > 0
    for _ in range(50):  # every speculative round takes 6x what the table says
        policy.slowdown.expect(True, 0.01)
        policy.slowdown.observe(0.06)
    assert predicted_speedup(policy, 1, acceptance) < 1.0 and policy.choose(1, acceptance.expected_tokens) == 0


def test_endpoint_heartbeat_fields_flatten_its_capacity_report():
    report = CapacityReport(endpoint_id="ep", max_sessions=8, active_sessions=3, draft_busy_ratio=0.25,
                            models=(ModelReport("m", (), None),),
                            tenants=(TenantReport("a", 2, 30, 15), TenantReport("b", 1, 10, 5)))
    fields = heartbeat_fields(report, "127.0.0.1:7100")
    assert fields == {"address": "127.0.0.1:7100", "models": ["m"], "max_sessions": 8, "active_sessions": 3,
                      "draft_busy_ratio": 0.25, "acceptance": 0.5, "hit_ratio": 0.0}


def test_target_heartbeat_fields_read_the_live_process():
    from types import SimpleNamespace

    from specpool.target_service.metrics import TargetMetrics
    from specpool.target_service.registration import HeartbeatFields
    from specpool.target_service.remote.drafter import RunningMean

    metrics = TargetMetrics("m", "t1")
    metrics.accept_length.observe(2.0)
    metrics.accept_length.observe(3.0)
    draft = SpeculationPolicy(costs(0.01), costs(0.001), max_draft=8)
    drafter = SimpleNamespace(address="h:9", healthy=True, wire_s=RunningMean(0.0))
    live = HeartbeatFields(
        "h:1", "m", "t1", 16, scheduler=SimpleNamespace(load=lambda: (15, 2)),
        decoder=SimpleNamespace(acceptance_of=lambda method: AcceptanceEstimate(prior_alpha=0.3)), metrics=metrics,
        drafter=drafter, free_policy=SpeculationPolicy(costs(0.0001)), draft_policy_fn=lambda: draft,
    )
    fields = live.fields()
    assert fields["running"] == 15 and fields["queued"] == 2 and fields["mean_accept_len"] == 2.5
    assert fields["predicted_speedup_draft"] == round(predicted_speedup(draft, 16, AcceptanceEstimate(prior_alpha=0.3)), 4) < 1.0
    assert fields["predicted_speedup_ngram"] > 1.0
    assert fields["spec_endpoint"] == "h:9" and fields["methods"] == ["draft_model", "ssd", "ngram"]
    # Remote rounds pay the measured wire time: one as long as a step leaves no method worth planning.
    drafter.wire_s.value = costs(0.0001)(16, 0)
    assert live.fields()["predicted_speedup_ngram"] < 1.0
    # An endpoint whose rounds keep coming late (breaker open): routers stop choosing drafts on it.
    late = HeartbeatFields("h:1", "m", "t1", 16, scheduler=SimpleNamespace(load=lambda: (0, 0)),
                           decoder=SimpleNamespace(acceptance_of=lambda method: AcceptanceEstimate()), metrics=metrics,
                           drafter=SimpleNamespace(address="h:9", healthy=False, wire_s=RunningMean(0.0)),
                           free_policy=None).fields()
    assert late["methods"] == ["ngram"]


def test_a_registry_password_is_never_shown():
    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://svc:s3cret@redis.example:6380/1") == "rediss://svc:***@redis.example:6380/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("via", ["--redis", "SPECPOOL_REDIS_URL"])
def test_a_router_logs_its_registry_without_the_password(redis_server, via):
    """Issue 14: the router printed the Redis URL, password included, in its startup and retry lines.
    The test Redis has a password (cluster/redis_server.py puts it in its URL); the router is given the
    URL as an argument or, as `specpool up` and the chart do, in the environment."""
    url = redis_server.url
    assert redis_server.password and f":{redis_server.password}@" in url
    args = ["serve-router", "--port", "0", "--metrics-port", "0"]
    if via == "--redis":
        router = start_server("router", [*args, "--redis", url])
    else:
        router = start_server("router", args, env={"SPECPOOL_REDIS_URL": url})
    router.stop()
    assert redis_server.password not in router.logs()
    assert redacted(url) in router.logs()
