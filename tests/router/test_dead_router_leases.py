"""A router SIGKILLed while it holds draft-slot leases: its slots free within 15 s, and a surviving
router places speculation on that endpoint again. Real Redis and router processes with their default
flags; the endpoint and the target are fakes that register like real ones (no model needed)."""

from __future__ import annotations

import itertools
import time

import pytest

from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.registry import Heartbeat, Registry
from specpool_client import generate_result
from tests.router.test_router import DRAFT, NGRAM, FakeTarget, request, stub, wait_for_model

MODEL, ENDPOINT, SLOTS = "lease-model", "lease-ep", 4


@pytest.fixture
def pool():
    redis_server = start_redis()
    url = redis_server.url
    endpoint = Heartbeat(url, "endpoint", ENDPOINT, lambda: {
        "address": "127.0.0.1:1", "models": [MODEL], "max_sessions": SLOTS}, ttl_s=1.0, interval_s=0.1).start()
    target = FakeTarget("lease-t", MODEL, url, draft=1.5, ngram=1.2, spec_endpoint="127.0.0.1:1")
    routers: list[ServerProcess] = []
    registry = Registry(url)
    try:
        for name in ("router-doomed", "router-survivor"):
            routers.append(start_server(name, ["serve-router", "--host", "127.0.0.1", "--port", "0",
                                               "--metrics-port", "0", "--redis", url]))
        for r in routers:
            wait_for_model(r, MODEL)
        yield routers, target, registry
    finally:
        for r in routers:
            r.stop()
        registry.close()
        target.close()
        endpoint.stop()
        redis_server.close()


def test_a_killed_routers_leases_free_within_15_s(pool):
    (doomed, survivor), target, registry = pool
    target.gate.clear()  # requests stay in flight, holding their slots
    in_flight = []  # referenced until the end: a collected call would be cancelled, releasing its slot
    for i in range(SLOTS):
        call = stub(doomed).Generate(request(MODEL, f"doomed-{i}", method=DRAFT), timeout=60)
        next(call)
        in_flight.append(call)
    assert list(target.methods().values()) == [DRAFT] * SLOTS
    assert sum(registry.held(ENDPOINT).values()) == SLOTS

    probe = stub(survivor).Generate(request(MODEL, "before", method=DRAFT), timeout=60)
    next(probe)
    assert target.methods()["before"] == NGRAM, "all slots are leased: no_slot"
    probe.cancel()

    doomed.kill()  # SIGKILL: nothing is released, renewals stop
    killed = time.monotonic()
    target.gate.set()
    wait_for(lambda: sum(registry.held(ENDPOINT).values()) == 0, timeout_s=15, interval_s=0.2)
    freed = time.monotonic() - killed

    attempts = itertools.count()

    def speculates() -> bool:
        rid = f"after-{next(attempts)}"
        generate_result(stub(survivor), request(MODEL, rid, method=DRAFT), timeout=30)
        return target.methods()[rid] == DRAFT

    wait_for(speculates, timeout_s=max(0.5, 15 - (time.monotonic() - killed)), interval_s=0.2)
    placed = time.monotonic() - killed
    print(f"leases of the killed router freed after {freed:.1f}s; the survivor drafted again after {placed:.1f}s")
