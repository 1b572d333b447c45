"""One request's route: which target replica, which speculation method, which draft slot.

`Router.route` reads the registry snapshot, places the request (router.placement), decides how it
speculates (router.decisions) leasing a slot on the target's endpoint when it drafts with a model, and returns
the request to forward. `Router.finish` releases the slot. No state outlives a request but the
leases, which live in Redis, and each target's count of probe-eligible requests (decisions.Probes), which is
this replica's own: replicas probe independently, each at the same rate.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis

from specpool.common.errors import FieldError
from specpool.common.registry_schema import EndpointRegistration, TargetRegistration
from specpool.common.speculation import method_to_pb
from specpool.common.target_api import check_generate_request
from specpool.router.decisions import Decision, LeaseUnavailable, Placed, Probes, decide, draft_endpoint
from specpool.router.leases import LEASE_TTL_S, Lease, LeaseKeeper
from specpool.router.metrics import RouterMetrics
from specpool.router.placement import PlacementRequest, place
from specpool.router.view import ClusterView, Snapshot
from specpool_client.v1 import target_pb2 as pb

log = logging.getLogger(__name__)

MAX_TENANT_CHARS = 128
DEFAULT_TENANT = "default"


class RoutingError(Exception):
    """Why a request cannot be routed: the field at fault and the gRPC status to answer with."""

    def __init__(self, field: str, message: str, code: grpc.StatusCode):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.code = field, message, code


@dataclass
class Route:
    target: TargetRegistration
    request: pb.GenerateRequest  # what is forwarded: request id, model and method filled in
    decision: Decision
    tenant: str
    lease: Lease | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def model(self) -> str:
        return self.target.model


@dataclass(frozen=True, slots=True)
class RouterConfig:
    port: int = 50070
    metrics_port: int = 9470
    host: str = "127.0.0.1"
    redis_url: str = "redis://127.0.0.1:6379/0"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    lease_ttl_s: float = LEASE_TTL_S
    busy_limit: float = 0.95  # endpoint draft_busy_ratio at which AUTO stops choosing the draft model
    grace_s: float = 10.0
    check_interval_s: float = 1.0  # while Redis is unreachable: direct health checks of the known members


class Router:
    def __init__(self, view: ClusterView, leases: LeaseKeeper, metrics: RouterMetrics, config: RouterConfig):
        self.view = view
        self.leases = leases
        self.metrics = metrics
        self.config = config
        self.probes = Probes()
        self.placed = Placed()

    def route(self, request: pb.GenerateRequest, tenant: str | None,
              exclude: frozenset[str] = frozenset()) -> Route:
        """tenant: who the draft slot is leased for; None (no x-specpool-tenant) leases it for the
        placed target's own tenant (its service id, as endpoints know it), else "default"."""
        start = time.perf_counter()
        try:
            requested = check_generate_request(request)  # first: bad input is INVALID_ARGUMENT, up or not
        except FieldError as e:
            raise RoutingError(e.field, e.message, grpc.StatusCode.INVALID_ARGUMENT) from None
        snapshot = self.view.snapshot()
        model = self._model(request, snapshot)
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.model = model
        if not forwarded.request_id:
            forwarded.request_id = uuid.uuid4().hex  # so Cancel can find it, and ties spread
        where = PlacementRequest(model, forwarded.request_id if not request.session_id else request.session_id,
                                 request.session_id, exclude)
        target = place(where, snapshot.targets)
        if target is None:
            raise RoutingError("model", f"no live target replica serves {model!r} right now",
                               grpc.StatusCode.UNAVAILABLE)
        endpoint = draft_endpoint(target, snapshot.endpoints)
        tenant = tenant or target.tenant or DEFAULT_TENANT
        held: list[Lease] = []

        def take_slot(e: EndpointRegistration) -> bool:
            try:
                lease = self.leases.acquire(e.id, tenant, e.max_sessions, forwarded.request_id)
            except redis.RedisError as err:
                self.metrics.registry_errors.labels(op="acquire").inc()
                log.warning("cannot lease a draft slot on %s (%s); running without", e.id, err)
                raise LeaseUnavailable from err
            if lease is not None:
                held.append(lease)
            return lease is not None

        decision = decide(requested, target, endpoint, take_slot, self.config.busy_limit,
                          probe_due=lambda: self.probes.due(target.id), placed=self.placed.since(target))
        self.placed.add(target.id, forwarded.request_id)
        forwarded.speculation.method = method_to_pb(decision.method)
        # The label keeps its name "plan", as dashboards and the capacity API know it.
        self.metrics.decisions.labels(model=model, plan=decision.method, reason=decision.reason).inc()
        self.metrics.leases_held.set(self.leases.held())
        self.metrics.placement_seconds.observe(time.perf_counter() - start)
        return Route(target, forwarded, decision, tenant, held[0] if held else None)

    def release(self, route: Route) -> None:
        """Frees the route's draft slot, if it holds one; call once per route (or finish)."""
        self.placed.remove(route.target.id, route.request.request_id)
        if route.lease is not None:
            self.leases.release(route.lease)
            self.metrics.leases_held.set(self.leases.held())

    def finish(self, route: Route, outcome: str) -> None:
        """Releases the route's slot and records the request; call once per request, on its last route."""
        self.release(route)
        self.metrics.requests.labels(model=route.model, outcome=outcome).inc()
        self.metrics.request_seconds.labels(model=route.model, plan=route.decision.method).observe(
            time.monotonic() - route.started_at)

    def _model(self, request: pb.GenerateRequest, snapshot: Snapshot) -> str:
        models = snapshot.models()
        if request.model:
            if request.model not in models:
                raise RoutingError("model", f"no live target serves {request.model!r} (serving: {models})",
                                   grpc.StatusCode.NOT_FOUND if snapshot.reachable else grpc.StatusCode.UNAVAILABLE)
            return request.model
        if len(models) == 1:
            return models[0]
        if not models:
            why = "the registry is unreachable" if not snapshot.reachable else "no target is registered"
            raise RoutingError("model", f"no live target replica ({why})", grpc.StatusCode.UNAVAILABLE)
        raise RoutingError("model", f"required: this pool serves several models {models}",
                           grpc.StatusCode.INVALID_ARGUMENT)


def tenant_of(metadata) -> str | None:
    """The requesting tenant from gRPC metadata x-specpool-tenant; None when absent or empty."""
    for key, value in metadata or ():
        if key == "x-specpool-tenant":
            tenant = value.strip() if isinstance(value, str) else ""
            if len(tenant) > MAX_TENANT_CHARS:
                raise RoutingError("x-specpool-tenant", f"at most {MAX_TENANT_CHARS} characters, got {len(tenant)}",
                                   grpc.StatusCode.INVALID_ARGUMENT)
            return tenant or None
    return None
