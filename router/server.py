"""`specpool serve-router`: the Target API in front of a pool of target replicas, plus ClusterState.

The servicer only translates and forwards: `Router` chooses the replica, the speculation plan and the
draft slot; the request goes to the replica with its method set, responses stream back, and the slot
is released when the call ends however it ends (completion, error, Cancel, client gone).

A replica that fails (UNAVAILABLE: down, unreachable, draining) is left for the next best one until
none is left. Before anything was streamed the request is simply placed again. Mid-stream it migrates:
the next replica continues from the prompt plus the tokens the client already has (resume_token_ids),
and the client sees one unbroken stream. That is lossless: greedy, the same tokens; sampling, the
continuation of a prefix the target model produced is drawn from the same distribution.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specpool.router.capacity import capacity_json, cluster_capacity, visible_to
from specpool.router.leases import LEASE_TTL_S, LeaseKeeper
from specpool.router.metrics import RouterMetrics
from specpool.router.routing import Route, Router, RouterConfig, RoutingError, tenant_of
from specpool.router.view import ClusterView, DirectChecks

from specpool.common.registry import Registry, redacted
from specpool.common.security import TENANT_HEADER, Security
from specpool.common.serving import (
    MESSAGE_SIZE_OPTIONS,
    Admission,
    MetricsHttpServer,
    abort_invalid,
    add_health_and_reflection,
    add_security_arguments,
    build_server,
    method_names,
    redis_url_from,
    report_ready,
    security_from,
    serve_until_signal,
    setup_logging,
)
from specpool.v1 import cluster_pb2, cluster_pb2_grpc, target_pb2_grpc
from specpool.v1 import target_pb2 as pb

log = logging.getLogger("specpool.router")

# gRPC's default reconnect backoff grows to 120 s: a member back on its address after a long absence
# would look down that long to requests and to direct health checks.
CHANNEL_OPTIONS = [*MESSAGE_SIZE_OPTIONS, ("grpc.max_reconnect_backoff_ms", 5000)]


class TargetChannels:
    """One channel per member, shared by all requests and health checks.

    A member is dialled as what the registry says is at its address (`name_of`: ("target", tenant) or
    ("endpoint", id)), and its certificate must name exactly that: anyone can write a heartbeat into
    Redis, only the cluster's CA can make a certificate for <tenant>.target.specpool.
    """

    def __init__(self, credentials: Security, name_of: Callable[[str], tuple[str, str] | None]):
        self.credentials = credentials
        self.name_of = name_of
        self._channels: dict[tuple[str, tuple[str, str] | None], grpc.Channel] = {}
        self._stubs: dict[tuple[str, tuple[str, str] | None], target_pb2_grpc.TargetServiceStub] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.Channel:
        name = self.name_of(address)
        with self._lock:
            channel = self._channels.get((address, name))
            if channel is None:
                # Not in the registry (any more): expect a name no certificate carries.
                role, member = name or ("target", "unregistered")
                channel = self._channels[(address, name)] = self.credentials.channel(
                    address, role, member, options=CHANNEL_OPTIONS)
            return channel

    def stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        key = (address, self.name_of(address))
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = target_pb2_grpc.TargetServiceStub(self.channel(address))
        return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()

    def health_check(self, timeout_s: float) -> Callable[[list[str]], list[bool]]:
        """check(addresses) for DirectChecks: grpc.health.v1 Check of every address at once; True where
        it answered SERVING (a draining member answers NOT_SERVING) within timeout_s."""
        def check(addresses: list[str]) -> list[bool]:
            futures = [health_pb2_grpc.HealthStub(self.channel(a)).Check.future(
                health_pb2.HealthCheckRequest(), timeout=timeout_s) for a in addresses]
            return [_serving(f) for f in futures]

        return check


def _serving(future) -> bool:
    try:
        return future.result().status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.RpcError, ValueError):  # ValueError: the channel was closed (shutting down)
        return False


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


class _Stream:
    """What one call has streamed to its client, so that another replica can continue it."""

    def __init__(self, request: pb.GenerateRequest):
        if not request.request_id:  # one id for every replica the request visits, so Cancel finds it
            request = _copy(request)
            request.request_id = uuid.uuid4().hex
        self.request = request
        self.tokens: list[int] = []  # delivered token ids (of the one completion when movable)
        self.text = ""
        self.sent_any = False
        self.final_sent = False
        self.refused: grpc.RpcError | None = None  # the last replica's RESOURCE_EXHAUSTED, if it was full

    def sent(self, msg: pb.GenerateResponse) -> None:
        self.sent_any = True
        if msg.HasField("delta"):
            self.tokens.extend(msg.delta.token_ids)
            self.text += msg.delta.text
        else:
            self.final_sent = True

    def movable(self) -> bool:
        # n > 1 streams interleave completions, which a replica cannot resume: once anything was sent
        # such a stream fails with its replica, as it did before migration existed.
        return not self.sent_any or self.request.n <= 1

    def next_request(self) -> pb.GenerateRequest | None:
        """The request to place: the original until tokens were delivered, then its continuation;
        None when nothing is left to generate (see final)."""
        if not self.tokens:
            return self.request
        remaining = self.request.max_tokens - len(self.tokens)
        if remaining < 1 or self.tokens[-1] in self.request.stop_token_ids:
            return None
        resumed = _copy(self.request)
        resumed.resume_token_ids.extend(self.tokens)
        resumed.max_tokens = remaining
        return resumed

    def final(self, model: str) -> pb.GenerateResponse:
        """The final message when the replica died between the last token and its final message, from
        what was streamed: no speculation statistics, prompt_tokens only for prompt_ids. (A model's own
        end-of-sequence token is not known here; a stream cut right after one is continued.)"""
        stopped = self.tokens[-1] in self.request.stop_token_ids
        token_ids = [*self.request.resume_token_ids, *self.tokens]
        return pb.GenerateResponse(request_id=self.request.request_id, final=pb.GenerateResult(
            request_id=self.request.request_id, model=model,
            completions=[pb.Completion(index=0, token_ids=token_ids, text=self.text,
                                       finish_reason="stop" if stopped else "length")],
            usage=pb.Usage(prompt_tokens=len(self.request.prompt_ids.ids), completion_tokens=len(token_ids))))


def _copy(request: pb.GenerateRequest) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    return out


class RouterServicer(target_pb2_grpc.TargetServiceServicer):
    """The tenant of a call is the one its bearer token names; requests are forwarded with it in
    x-specpool-tenant, which targets believe only from a router's certificate. So a request id is the
    tenant's own: another tenant's Cancel of it finds nothing."""

    def __init__(self, router: Router, channels: TargetChannels, credentials: Security):
        self.router = router
        self.channels = channels
        self.credentials = credentials

    def Generate(self, request, context):
        tenant = self._tenant(context)
        current: list[_Forwarding] = []
        self._on_termination(context, current)
        exclude: set[str] = set()
        stream = _Stream(request)
        model = ""
        while True:
            forwarded = stream.next_request()
            if forwarded is None:  # the replica died after the last token, before its final message
                yield stream.final(model)
                return
            fwd = self._forwarding(forwarded, tenant, exclude, context, current, stream)
            model = fwd.route.model
            if stream.tokens:
                self.router.metrics.migrations.labels(model=model).inc()
            try:
                call = self.channels.stub(fwd.route.target.address).Generate(
                    fwd.route.request, timeout=_remaining(context), metadata=_on_behalf_of(tenant))
                fwd.attach(call)
                for msg in call:
                    if not stream.sent_any and msg.HasField("delta"):
                        self.router.metrics.ttft.labels(model=model).observe(time.monotonic() - fwd.route.started_at)
                    stream.sent(msg)
                    yield msg
                fwd.finish("ok")
                return
            except grpc.RpcError as e:
                if stream.final_sent:  # only the call's trailers were lost: the client has everything
                    fwd.finish("ok")
                    return
                if self._place_again(e, fwd, exclude, context, stream):
                    continue
                fwd.finish("error")
                _abort_like(context, e)
            finally:
                fwd.finish("cancelled")  # the client went away while we were yielding (GeneratorExit)

    def GenerateUnary(self, request, context):
        tenant = self._tenant(context)
        current: list[_Forwarding] = []
        self._on_termination(context, current)
        exclude: set[str] = set()
        stream = _Stream(request)  # never sends anything: a failed replica only means placing it again
        while True:
            fwd = self._forwarding(stream.request, tenant, exclude, context, current, stream)
            try:
                future = self.channels.stub(fwd.route.target.address).GenerateUnary.future(
                    fwd.route.request, timeout=_remaining(context), metadata=_on_behalf_of(tenant))
                fwd.attach(future)
                result = future.result()
                fwd.finish("ok")
                return result
            except grpc.FutureCancelledError:
                fwd.finish("cancelled")
                context.abort(grpc.StatusCode.CANCELLED, "request: cancelled")
            except grpc.RpcError as e:
                if self._place_again(e, fwd, exclude, context, stream):
                    continue
                fwd.finish("error")
                _abort_like(context, e)
            finally:
                fwd.finish("cancelled")

    def Cancel(self, request, context):
        """Routers keep no request table: every live replica is asked, and any that ran it (for this
        tenant) says so. NOT_FOUND when none did, whoever's the id is: ids tell nothing about others."""
        tenant = self._tenant(context)
        if not request.request_id:
            abort_invalid(context, "request_id", "is required")
        targets = self.router.view.snapshot().targets
        futures = [self.channels.stub(t.address).Cancel.future(request, timeout=5.0, metadata=_on_behalf_of(tenant))
                   for t in targets]
        cancelled = False
        for f in futures:
            try:
                cancelled = f.result().cancelled or cancelled
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    log.debug("Cancel on a replica failed: %s", e.code().name)
        if not cancelled:
            abort_invalid(context, "request_id", f"no running request {request.request_id!r} of yours",
                          grpc.StatusCode.NOT_FOUND)
        return pb.CancelResponse(cancelled=True)

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
        caller = self.credentials.caller(context)
        if caller is not None and not caller.anonymous:
            return caller.name
        try:  # --insecure: the caller says who it is
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
                    current: list[_Forwarding], stream: _Stream) -> _Forwarding:
        try:
            route = self.router.route(request, tenant, frozenset(exclude))
        except RoutingError as e:
            if stream.tokens:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"request: {len(stream.tokens)} tokens were delivered, "
                              f"then its replica failed and no other can continue it ({e.field}: {e.message})")
            if stream.refused is not None:  # every replica left was full: their refusal, retry hint and all
                _abort_like(context, stream.refused)
            abort_invalid(context, e.field, e.message, e.code)
        fwd = _Forwarding(self.router, route)
        current[:] = [fwd]
        if not context.is_active():  # the client left while we placed it
            fwd.cancel()
            fwd.finish("cancelled")
            context.abort(grpc.StatusCode.CANCELLED, "request: cancelled")
        return fwd

    def _place_again(self, error: grpc.RpcError, fwd: _Forwarding, exclude: set[str], context,
                     stream: _Stream) -> bool:
        """Whether to go on to the next best replica: this one is unavailable (or full, before it streamed
        anything), the client still waits, and the stream can be continued. Each failed replica is
        excluded, so this ends."""
        if not context.is_active():
            fwd.finish("cancelled")
            return False
        full = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not stream.sent_any
        if not (full or error.code() == grpc.StatusCode.UNAVAILABLE and stream.movable()):
            return False
        if full:
            stream.refused = error
        exclude.add(fwd.route.target.id)
        if stream.tokens:
            log.warning("replica %s failed after %d tokens of request %s (%s); continuing it on another",
                        fwd.route.target.id, len(stream.tokens), stream.request.request_id, error.details())
            fwd.finish("migrated")
        else:
            log.warning("replica %s %s (%s); placing the request again", fwd.route.target.id,
                        "full" if full else "unavailable", error.details())
            fwd.finish("retried")
            self.router.metrics.retries.labels(model=fwd.route.model).inc()
        return True


def _on_behalf_of(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return ((TENANT_HEADER, tenant),) if tenant else ()


def _abort_like(context, error: grpc.RpcError) -> None:
    """Ends the call with a replica's status, its google.rpc details (such as RetryInfo) included."""
    details = [(k, v) for k, v in error.trailing_metadata() or () if k == "grpc-status-details-bin"]
    if details:
        context.set_trailing_metadata(details)
    context.abort(error.code(), error.details() or error.code().name)


def _remaining(context) -> float | None:
    """The caller's deadline, passed on; None without one (gRPC reports that as a huge number)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e7 else None


class ClusterStateServicer(cluster_pb2_grpc.ClusterStateServicer):
    """A tenant sees the pools and endpoints, and of the per-tenant leases only its own."""

    def __init__(self, capacity, credentials: Security):
        self.capacity = capacity
        self.credentials = credentials

    def GetClusterCapacity(self, request, context):
        caller = self.credentials.caller(context)
        message = self.capacity()
        return message if caller is None or caller.anonymous else visible_to(message, caller.name)


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
    p.add_argument("--host", default="127.0.0.1",
                   help="address gRPC and /metrics listen on (default loopback; 0.0.0.0: every interface)")
    add_security_arguments(p)
    p.add_argument("--tokens", default=None, metavar="FILE",
                   help="YAML tenant -> bearer token(s): who may call this router, as which tenant (default: "
                        "$SPECPOOL_TOKENS_FILE, else tokens.yaml in a local CA's --tls-dir); re-read when it changes")
    p.add_argument("--name", default="router", help="this router's name in its certificate (router/<name>)")
    p.add_argument("--tenant-weights", default="", metavar="T=W,...",
                   help="weighted shares of each endpoint's draft slots per tenant: the caller's token's tenant "
                        "(x-specpool-tenant metadata with --insecure), else the placed target's --tenant; each is guaranteed "
                        "floor(slots * w / sum w); unlisted tenants only use unreserved slots")
    p.add_argument("--lease-ttl-s", type=float, default=LEASE_TTL_S,
                   help="draft-slot lease TTL in Redis, renewed every third of it while its request runs: "
                        "the slots of a router that dies free within this")
    p.add_argument("--busy-limit", type=float, default=0.95,
                   help="endpoint draft busy ratio from which AUTO requests stop choosing the draft model")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests this router forwards at once; more get RESOURCE_EXHAUSTED with a retry hint")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--check-interval-s", type=float, default=1.0,
                   help="while Redis is unreachable, the router health-checks the members it knew this often "
                        "and stops placing on one that fails two checks in a row")
    p.add_argument("--log-level", default="INFO")


def config_from(args: argparse.Namespace) -> RouterConfig:
    if args.lease_ttl_s <= 0:
        raise ValueError(f"--lease-ttl-s must be > 0, got {args.lease_ttl_s}")
    if not 0 < args.busy_limit <= 1:
        raise ValueError(f"--busy-limit must be in (0, 1], got {args.busy_limit}")
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if args.check_interval_s <= 0:
        raise ValueError(f"--check-interval-s must be > 0, got {args.check_interval_s}")
    redis_url = redis_url_from(args)
    if not redis_url:
        raise ValueError("the router needs the registry: set SPECPOOL_REDIS_URL or pass --redis URL")
    return RouterConfig(
        port=args.port, metrics_port=args.metrics_port, host=args.host, redis_url=redis_url,
        tenant_weights=parse_tenant_weights(args.tenant_weights), lease_ttl_s=args.lease_ttl_s,
        busy_limit=args.busy_limit, grace_s=args.grace_s, check_interval_s=args.check_interval_s,
    )


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = config_from(args)
    credentials = security_from(args, "router", args.name, tokens_file=args.tokens)
    if credentials.enabled and credentials.tokens is None:
        raise SystemExit("the router needs a tokens file to know its callers: --tokens FILE or SPECPOOL_TOKENS_FILE")
    registry = Registry(config.redis_url)
    metrics = RouterMetrics()
    channels = TargetChannels(credentials, lambda address: view.member_name(address))
    checks = DirectChecks(channels.health_check(timeout_s=min(1.0, config.check_interval_s)),
                          interval_s=config.check_interval_s)
    view = ClusterView(registry, checks=checks, on_error=lambda: metrics.registry_errors.labels(op="read").inc())
    keeper = LeaseKeeper(registry, config.tenant_weights, config.lease_ttl_s,
                         on_error=lambda op: metrics.registry_errors.labels(op=op).inc()).start()
    router = Router(view, keeper, metrics, config)
    try:
        registry.client.ping()
    except redis.RedisError as e:
        log.warning("registry %s not reachable yet (%s); requests fail until it is", redacted(config.redis_url), e)

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

    # Every forwarded request holds a server thread until its replica answers.
    service = pb.DESCRIPTOR.services_by_name["TargetService"]
    admission = Admission(args.max_in_flight, method_names(service, "Generate", "GenerateUnary"))
    # Tenants' programs call the router with bearer tokens, not certificates.
    server, port = build_server(config.port, host=config.host, admission=admission, credentials=credentials,
                                client_certificates=False)
    target_pb2_grpc.add_TargetServiceServicer_to_server(RouterServicer(router, channels, credentials), server)
    cluster_pb2_grpc.add_ClusterStateServicer_to_server(ClusterStateServicer(capacity, credentials), server)
    health = add_health_and_reflection(server, [
        pb.DESCRIPTOR.services_by_name["TargetService"].full_name,
        cluster_pb2.DESCRIPTOR.services_by_name["ClusterState"].full_name,
    ])
    # Over HTTP the per-tenant leases are for operators: those holding the metrics token.
    metrics_server = MetricsHttpServer(
        metrics.registry, config.metrics_port, host=args.metrics_host or config.host, health=health,
        json_routes={"/capacity": lambda operator: capacity_json(
            capacity() if operator else visible_to(capacity(), None))})
    metrics_server.start()
    server.start()
    health.set_ready(True)
    log.info("serving Router on port %d, metrics on port %d (registry %s, tenant weights %s)",
             port, metrics_server.port, redacted(config.redis_url), config.tenant_weights or "none")
    report_ready("Router", port, metrics_server.port)
    serve_until_signal(server, health, config.grace_s, metrics=metrics_server)
    keeper.stop()
    checks.close()
    channels.close()
    lookups.shutdown(wait=False)
    registry.close()
    return 0
