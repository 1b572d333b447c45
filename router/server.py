"""`specpool serve-router`: the Target API in front of a pool of target replicas, plus ClusterState.

The servicer only translates and forwards: `Router` chooses the replica, the speculation plan and the
draft slot; the request goes to the replica with its method set, responses stream back, and the slot
is released when the call ends however it ends (completion, error, Cancel, client gone). A replica
that is unreachable before it answered anything is retried once on the next best one.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis

from router.capacity import capacity_json, cluster_capacity
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.routing import Route, Router, RouterConfig, RoutingError, tenant_of
from router.view import ClusterView
from specpool.registry import Registry
from specpool.serving import (
    MetricsHttpServer,
    abort_invalid,
    add_health_and_reflection,
    build_server,
    serve_until_signal,
    setup_logging,
)
from specpool.v1 import cluster_pb2, cluster_pb2_grpc, target_pb2_grpc
from specpool.v1 import target_pb2 as pb

log = logging.getLogger("specpool.router")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_ATTEMPTS = 2  # one retry on another replica when the first is unreachable


class TargetChannels:
    """One channel per target address, shared by all requests."""

    def __init__(self):
        self._stubs: dict[str, target_pb2_grpc.TargetServiceStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = grpc.insecure_channel(address, options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ])
                self._channels.append(channel)
                stub = self._stubs[address] = target_pb2_grpc.TargetServiceStub(channel)
            return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


class _Forwarding:
    """One route's upstream call: cancelled when the client's call ends, finished exactly once."""

    def __init__(self, router: Router, route: Route):
        self.router = router
        self.route = route
        self._call = None
        self._cancelled = False
        self._finished = False
        self._lock = threading.Lock()

    def attach(self, call) -> None:
        with self._lock:
            self._call = call
            cancelled = self._cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def finish(self, outcome: str) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.router.finish(self.route, outcome)


class RouterServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, router: Router, channels: TargetChannels):
        self.router = router
        self.channels = channels

    def Generate(self, request, context):
        tenant = self._tenant(context)
        current: list[_Forwarding] = []
        self._on_termination(context, current)
        exclude: set[str] = set()
        sent_any = False
        while True:
            fwd = self._forwarding(request, tenant, exclude, context, current)
            try:
                call = self.channels.stub(fwd.route.target.address).Generate(
                    fwd.route.request, timeout=_remaining(context))
                fwd.attach(call)
                for msg in call:
                    if not sent_any and msg.HasField("delta"):
                        self.router.metrics.ttft.labels(model=fwd.route.model).observe(
                            time.monotonic() - fwd.route.started_at)
                    sent_any = True
                    yield msg
                fwd.finish("ok")
                return
            except grpc.RpcError as e:
                if self._retry(e, fwd, exclude, context, sent_any):
                    continue
                fwd.finish("error")
                context.abort(e.code(), e.details() or e.code().name)
            finally:
                fwd.finish("cancelled")  # the client went away while we were yielding (GeneratorExit)

    def GenerateUnary(self, request, context):
        tenant = self._tenant(context)
        current: list[_Forwarding] = []
        self._on_termination(context, current)
        exclude: set[str] = set()
        while True:
            fwd = self._forwarding(request, tenant, exclude, context, current)
            try:
                future = self.channels.stub(fwd.route.target.address).GenerateUnary.future(
                    fwd.route.request, timeout=_remaining(context))
                fwd.attach(future)
                result = future.result()
                fwd.finish("ok")
                return result
            except grpc.FutureCancelledError:
                fwd.finish("cancelled")
                context.abort(grpc.StatusCode.CANCELLED, "request: cancelled")
            except grpc.RpcError as e:
                if self._retry(e, fwd, exclude, context, sent_any=False):
                    continue
                fwd.finish("error")
                context.abort(e.code(), e.details() or e.code().name)
            finally:
                fwd.finish("cancelled")

    def Cancel(self, request, context):
        """Routers keep no request table: every live replica is asked, and any that ran it says so."""
        if not request.request_id:
            abort_invalid(context, "request_id", "is required")
        targets = self.router.view.snapshot().targets
        futures = [self.channels.stub(t.address).Cancel.future(request, timeout=5.0) for t in targets]
        cancelled = False
        for f in futures:
            try:
                cancelled = f.result().cancelled or cancelled
            except grpc.RpcError as e:
                log.debug("Cancel on a replica failed: %s", e.code().name)
        return pb.CancelResponse(cancelled=cancelled)

    def GetInfo(self, request, context):
        """The pool as one service: summed capacity and load; the model when the pool serves one."""
        snapshot = self.router.view.snapshot()
        models = snapshot.models()
        info = pb.TargetInfo(
            service_id="router", model=models[0] if len(models) == 1 else "",
            max_batch=sum(t.max_batch for t in snapshot.targets),
            active_sequences=sum(t.running for t in snapshot.targets),
            queued_requests=sum(t.queued for t in snapshot.targets),
            spec_endpoint=",".join(e.address for e in snapshot.endpoints),
            spec_endpoint_attached=any(t.spec_endpoint for t in snapshot.targets),
        )
        if len(models) == 1 and snapshot.targets:
            try:  # the vocabulary is not in the registry: ask one replica
                info.vocab_size = self.channels.stub(snapshot.targets[0].address).GetInfo(
                    pb.GetInfoRequest(), timeout=2.0).vocab_size
            except grpc.RpcError:
                pass
        return info

    # -- helpers ------------------------------------------------------------------------------------

    def _tenant(self, context) -> str | None:
        try:
            return tenant_of(context.invocation_metadata())
        except RoutingError as e:
            abort_invalid(context, e.field, e.message, e.code)

    def _on_termination(self, context, current: list[_Forwarding]) -> None:
        def ended() -> None:
            for fwd in list(current):
                fwd.cancel()
                fwd.finish("cancelled")

        context.add_callback(ended)

    def _forwarding(self, request, tenant: str | None, exclude: set[str], context,
                    current: list[_Forwarding]) -> _Forwarding:
        try:
            route = self.router.route(request, tenant, frozenset(exclude))
        except RoutingError as e:
            abort_invalid(context, e.field, e.message, e.code)
        fwd = _Forwarding(self.router, route)
        current[:] = [fwd]
        if not context.is_active():  # the client left while we placed it
            fwd.cancel()
            fwd.finish("cancelled")
            context.abort(grpc.StatusCode.CANCELLED, "request: cancelled")
        return fwd

    def _retry(self, error: grpc.RpcError, fwd: _Forwarding, exclude: set[str], context, sent_any: bool) -> bool:
        if not context.is_active():
            fwd.finish("cancelled")
            return False
        if error.code() != grpc.StatusCode.UNAVAILABLE or sent_any or len(exclude) + 1 >= MAX_ATTEMPTS:
            return False
        log.warning("replica %s unavailable (%s); placing the request again", fwd.route.target.id, error.details())
        fwd.finish("retried")
        exclude.add(fwd.route.target.id)
        self.router.metrics.retries.labels(model=fwd.route.model).inc()
        return True


def _remaining(context) -> float | None:
    """The caller's deadline, passed on; None without one (gRPC reports that as a huge number)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e7 else None


class ClusterStateServicer(cluster_pb2_grpc.ClusterStateServicer):
    def __init__(self, capacity):
        self.capacity = capacity

    def GetClusterCapacity(self, request, context):
        return self.capacity()


# -- process entry point ---------------------------------------------------------------------------


def parse_tenant_weights(text: str) -> dict[str, float]:
    """"alpha=1,beta=2" -> {"alpha": 1.0, "beta": 2.0}; weights must be > 0."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not tenant.strip() or not weight > 0 or weight == float("inf"):
            raise ValueError(f"--tenant-weights: {item!r} is not TENANT=WEIGHT with a weight > 0")
        weights[tenant.strip()] = weight
    return weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=50070, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=9470,
                   help="Prometheus /metrics and /capacity port (0 picks)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--redis", required=True, metavar="URL",
                   help="the cluster registry, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--tenant-weights", default="", metavar="T=W,...",
                   help="weighted shares of each endpoint's draft slots per tenant: the caller's gRPC metadata "
                        "x-specpool-tenant, else the placed target's --tenant; each is guaranteed "
                        "floor(slots * w / sum w); unlisted tenants only use unreserved slots")
    p.add_argument("--lease-ttl-s", type=float, default=600.0,
                   help="a draft slot's lease outlives a router that died holding it by at most this")
    p.add_argument("--busy-limit", type=float, default=0.95,
                   help="endpoint draft busy ratio from which AUTO requests stop choosing the draft model")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")


def config_from(args: argparse.Namespace) -> RouterConfig:
    if args.lease_ttl_s <= 0:
        raise ValueError(f"--lease-ttl-s must be > 0, got {args.lease_ttl_s}")
    if not 0 < args.busy_limit <= 1:
        raise ValueError(f"--busy-limit must be in (0, 1], got {args.busy_limit}")
    return RouterConfig(
        port=args.port, metrics_port=args.metrics_port, host=args.host, redis_url=args.redis,
        tenant_weights=parse_tenant_weights(args.tenant_weights), lease_ttl_s=args.lease_ttl_s,
        busy_limit=args.busy_limit, grace_s=args.grace_s,
    )


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = config_from(args)
    registry = Registry(config.redis_url)
    metrics = RouterMetrics()
    view = ClusterView(registry, on_error=lambda: metrics.registry_errors.labels(op="read").inc())
    keeper = LeaseKeeper(registry, config.tenant_weights, config.lease_ttl_s,
                         on_error=lambda op: metrics.registry_errors.labels(op=op).inc()).start()
    router = Router(view, keeper, metrics, config)
    try:
        registry.client.ping()
    except redis.RedisError as e:
        log.warning("registry %s not reachable yet (%s); requests fail until it is", config.redis_url, e)

    lookups = ThreadPoolExecutor(4, thread_name_prefix="capacity")

    def capacity() -> cluster_pb2.ClusterCapacity:
        def held(endpoint_id: str) -> dict[str, int] | None:
            try:
                return registry.held(endpoint_id)
            except redis.RedisError:
                return None

        snapshot = view.snapshot()
        ids = [e.id for e in snapshot.endpoints]
        holdings = dict(zip(ids, lookups.map(held, ids)))
        return cluster_capacity(snapshot, holdings.get, config.tenant_weights, metrics.decision_counts())

    channels = TargetChannels()
    server, port = build_server(config.port, host=config.host, max_message_bytes=MAX_MESSAGE_BYTES)
    target_pb2_grpc.add_TargetServiceServicer_to_server(RouterServicer(router, channels), server)
    cluster_pb2_grpc.add_ClusterStateServicer_to_server(ClusterStateServicer(capacity), server)
    health = add_health_and_reflection(server, [
        pb.DESCRIPTOR.services_by_name["TargetService"].full_name,
        cluster_pb2.DESCRIPTOR.services_by_name["ClusterState"].full_name,
    ])
    metrics_server = MetricsHttpServer(metrics.registry, config.metrics_port, host=config.host,
                                       json_routes={"/capacity": lambda: capacity_json(capacity())})
    metrics_server.start()
    server.start()
    health.set_ready(True)
    log.info("serving Router on port %d, metrics on port %d (registry %s, tenant weights %s)",
             port, metrics_server.port, config.redis_url, config.tenant_weights or "none")
    serve_until_signal(server, health, config.grace_s, metrics=metrics_server)
    keeper.stop()
    channels.close()
    lookups.shutdown(wait=False)
    registry.close()
    return 0
