"""specpool_router_guaranteed_slots: each weighted tenant's reserved draft slots on each live endpoint,
as the lease script reserves them (floor(max_sessions * weight / sum of weights)), read at scrape time."""

from prometheus_client import generate_latest

from specpool.common.registry_schema import EndpointRegistration
from specpool.router.metrics import RouterMetrics


def test_guaranteed_slots_follow_the_live_endpoints_and_the_weights():
    live = [EndpointRegistration(id="spec-1", address="a:1", models=("m",), max_sessions=16),
            EndpointRegistration(id="spec-2", address="b:1", models=("m",), max_sessions=5)]
    metrics = RouterMetrics()
    metrics.watch_guarantees(lambda: list(live), {"alpha": 1.0, "beta": 2.0})
    text = generate_latest(metrics.registry).decode()
    for endpoint, tenant, slots in (("spec-1", "alpha", 5), ("spec-1", "beta", 10),
                                    ("spec-2", "alpha", 1), ("spec-2", "beta", 3)):
        assert f'specpool_router_guaranteed_slots{{endpoint="{endpoint}",tenant="{tenant}"}} {slots}.0' in text
    live.pop()  # an endpoint that left has no guarantees any more
    assert 'endpoint="spec-2"' not in generate_latest(metrics.registry).decode()


def test_no_weights_no_series():
    metrics = RouterMetrics()
    metrics.watch_guarantees(lambda: [EndpointRegistration(id="e", address="a:1", models=("m",), max_sessions=8)], {})
    assert "specpool_router_guaranteed_slots{" not in generate_latest(metrics.registry).decode()
