"""The endpoint's SSD cache counters (hits and lookups, which add up across endpoints where the hit-ratio
gauge cannot), its capacity gauge, and the router's registry-error series that exist from the start."""

from __future__ import annotations

from types import SimpleNamespace

from specpool.engine.drafters.ssd_stats import SsdStats
from specpool.router.metrics import REGISTRY_OPS, RouterMetrics
from specpool.spec_endpoint.drafters import HostedDrafters
from specpool.spec_endpoint.endpoint import Endpoint, EndpointConfig
from specpool.spec_endpoint.metrics import EndpointMetrics


def ssd(hits: int, lookups: int, neural: int = 0) -> SimpleNamespace:
    stats = SsdStats(hits=hits, lookups=lookups)
    stats.backups["neural"] = neural
    return SimpleNamespace(stats=stats, forks=4)


def test_cache_counters_follow_each_drafters_running_totals():
    metrics = EndpointMetrics()
    draft, head = ssd(3, 10, neural=2), ssd(1, 2)  # two SSD drafters of one model (draft model, head)
    metrics.observe_prespeculation("m", draft)
    metrics.observe_prespeculation("m", head)
    draft.stats.hits, draft.stats.lookups, draft.stats.backups["neural"] = 5, 14, 3
    metrics.observe_prespeculation("m", draft)
    metrics.observe_prespeculation("m", draft)  # nothing new: nothing counted twice
    assert metrics.value("specpool_spec_ssd_cache_hits_total", {"model": "m"}) == 6
    assert metrics.value("specpool_spec_ssd_cache_lookups_total", {"model": "m"}) == 16
    assert metrics.value("specpool_spec_ssd_backups_total", {"model": "m", "backup": "neural"}) == 3
    # Both backups' series exist once the model pre-speculates, the unused one at 0.
    fast = {"model": "m", "backup": "fast"}
    assert metrics.registry.get_sample_value("specpool_spec_ssd_backups_total", fast) == 0
    # The gauge is the last drafter's own ratio; the counters' ratio is the model's.
    assert metrics.value("specpool_spec_ssd_cache_hit_ratio", {"model": "m"}) == 5 / 14


def test_max_sessions_and_registry_errors_exist_from_the_start():
    endpoint = Endpoint(HostedDrafters({}), EndpointConfig(max_sessions=32))
    assert endpoint.metrics.value("specpool_spec_max_sessions") == 32
    router = RouterMetrics()
    for op in REGISTRY_OPS:
        assert router.registry.get_sample_value("specpool_router_registry_errors_total", {"op": op}) == 0.0
