"""The router's Prometheus metrics (own registry; labelled by model/plan/reason, never by request id).

The label `plan` holds the speculation method chosen (a Method value); it keeps that name because
dashboards and the capacity API (DecisionCount.plan) know it by it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from specpool.common.outcomes import UNKNOWN_MODEL
from specpool.common.registry_leases import guarantees
from specpool.common.registry_schema import KINDS, EndpointRegistration

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# The registry operations whose failures are counted (server.py: read; routing.py: acquire; leases.py: renew,
# release): their series exist from the start, so an error rate reads 0 rather than nothing.
REGISTRY_OPS = ("read", "acquire", "renew", "release")


class RouterMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("specpool_router_decisions", "Speculation methods chosen, by reason",
                                 ["model", "plan", "reason"], registry=r)
        # Each client request once, however it ended (specpool/common/outcomes.py), refused ones included:
        # model "unknown" when it ended before it was placed.
        self.requests = Counter("specpool_router_requests", "Client requests by outcome: ok, cancelled, invalid, "
                                "not_found, unauthenticated, rejected, unavailable, expired, error", ["model", "outcome"], registry=r)
        self.request_seconds = Histogram("specpool_router_request_seconds", "Routing to the last response",
                                         ["model", "plan"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specpool_router_time_to_first_token_seconds",
                              "Routing to the first token (streaming requests)", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.placement_seconds = Histogram("specpool_router_placement_seconds",
                                           "Choosing replica, method and slot (registry reads included)",
                                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                                           registry=r)
        self.in_flight = Gauge("specpool_router_in_flight_requests", "Requests being forwarded to a replica now",
                               ["model"], registry=r)
        self.leases_held = Gauge("specpool_router_draft_leases_held", "Draft slots this replica holds", registry=r)
        self.registry_errors = Counter("specpool_router_registry_errors", "Redis operations that failed",
                                       ["op"], registry=r)
        for op in REGISTRY_OPS:
            self.registry_errors.labels(op=op)
        self.records_dropped = Counter("specpool_router_registry_records_dropped",
                                       "Registry records left out of a read because a field was malformed",
                                       ["kind"], registry=r)
        for kind in KINDS:
            self.records_dropped.labels(kind=kind)
        self.retries = Counter("specpool_router_retries", "Requests re-placed after a replica was unavailable",
                               ["model"], registry=r)
        self.migrations = Counter("specpool_router_migrations",
                                  "Streams continued on another replica after theirs failed mid-stream",
                                  ["model"], registry=r)
        self._guarantees = _Guarantees()  # no series until watch_guarantees
        r.register(self._guarantees)

    def watch_guarantees(self, endpoints: Callable[[], Iterable[EndpointRegistration]],
                         shares: Mapping[str, float]) -> None:
        """specpool_router_guaranteed_slots{endpoint, tenant}: the draft slots each weighted tenant is
        guaranteed on each live endpoint (what leases reserve), read from the registry view at scrape."""
        self._guarantees.endpoints, self._guarantees.shares = endpoints, shares

    def count(self, outcome: str, model: str = UNKNOWN_MODEL) -> None:
        """One request that ended without a route to count it (Router.finish counts those with one)."""
        self.requests.labels(model=model, outcome=outcome).inc()

    def decision_counts(self) -> list[tuple[str, str, str, int]]:
        """(model, method, reason, count) for every labelled series."""
        out = []
        for family in self.decisions.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    out.append((labels["model"], labels["plan"], labels["reason"], int(sample.value)))
        return sorted(out)


class _Guarantees(Collector):
    def __init__(self):
        self.endpoints: Callable[[], Iterable[EndpointRegistration]] = list
        self.shares: Mapping[str, float] = {}

    def collect(self):
        family = GaugeMetricFamily("specpool_router_guaranteed_slots", "Draft slots reserved for a weighted "
                                   "tenant on an endpoint: floor(max_sessions * weight / sum of weights)",
                                   labels=["endpoint", "tenant"])
        for endpoint in self.endpoints() if self.shares else ():
            for tenant, slots in guarantees(endpoint.max_sessions, self.shares).items():
                family.add_metric([endpoint.id, tenant], slots)
        yield family
