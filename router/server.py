"""`specpool serve-router`: the router's flags, and the process that wires its parts and serves them.

The services themselves are in router.servicer; placing a request is router.routing's.
"""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor

import redis

from specpool.common import http_limits, logs, outcomes, serving, write_deadline
from specpool.common.metrics_http import MetricsHttpServer
from specpool.common.registry import Registry, redacted
from specpool.router import http_guard
from specpool.router.capacity import capacity_json, cluster_capacity, visible_to
from specpool.router.leases import LEASE_TTL_S, LeaseKeeper
from specpool.router.member_channels import TargetChannels
from specpool.router.metrics import RouterMetrics
from specpool.router.openai_http import HttpFront
from specpool.router.routing import Router, RouterConfig
from specpool.router.servicer import ClusterStateServicer, RouterServicer
from specpool.router.view import ClusterView, DirectChecks
from specpool_client.v1 import cluster_pb2, cluster_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb

log = logging.getLogger("specpool.router")


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
    p.add_argument("--http-port", type=int, default=0,
                   help="OpenAI-compatible HTTP front on --host (/v1/completions, /v1/chat/completions, /v1/models; "
                        "HTTPS with this router's certificate unless --insecure): 0 picks a free port, -1: none")
    p.add_argument("--host", default="127.0.0.1",
                   help="address gRPC and /metrics listen on (default loopback; 0.0.0.0: every interface)")
    serving.add_security_arguments(p)
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
    http_guard.add_arguments(p)
    write_deadline.add_argument(p)
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--check-interval-s", type=float, default=1.0,
                   help="while Redis is unreachable, the router health-checks the members it knew this often "
                        "and stops placing on one that fails two checks in a row")
    p.add_argument("--log-level", default="INFO", help="Python logging level: DEBUG, INFO, WARNING or ERROR")
    logs.add_arguments(p)


def config_from(args: argparse.Namespace) -> RouterConfig:
    if args.lease_ttl_s <= 0:
        raise ValueError(f"--lease-ttl-s must be > 0, got {args.lease_ttl_s}")
    if not 0 < args.busy_limit <= 1:
        raise ValueError(f"--busy-limit must be in (0, 1], got {args.busy_limit}")
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if args.check_interval_s <= 0:
        raise ValueError(f"--check-interval-s must be > 0, got {args.check_interval_s}")
    redis_url = serving.redis_url_from(args)
    if not redis_url:
        raise ValueError("the router needs the registry: set SPECPOOL_REDIS_URL or pass --redis URL")
    return RouterConfig(
        port=args.port, metrics_port=args.metrics_port, host=args.host, redis_url=redis_url,
        tenant_weights=parse_tenant_weights(args.tenant_weights), lease_ttl_s=args.lease_ttl_s,
        busy_limit=args.busy_limit, grace_s=args.grace_s, check_interval_s=args.check_interval_s,
    )


def main(args: argparse.Namespace) -> int:
    serving.setup_logging(args.log_level, args.log_format)
    config = config_from(args)
    limits = http_limits.from_args(args)
    tenant_limits = http_guard.from_args(args)
    credentials = serving.security_from(args, "router", args.name, tokens_file=args.tokens)
    if credentials.enabled and credentials.tokens is None:
        raise SystemExit("the router needs a tokens file to know its callers: --tokens FILE or SPECPOOL_TOKENS_FILE")
    metrics = RouterMetrics()
    registry = Registry(config.redis_url, on_dropped=lambda kind: metrics.records_dropped.labels(kind=kind).inc())
    channels = TargetChannels(credentials, lambda address: view.member_name(address))
    checks = DirectChecks(channels.health_check(timeout_s=min(1.0, config.check_interval_s)),
                          interval_s=config.check_interval_s)
    view = ClusterView(registry, checks=checks, on_error=lambda: metrics.registry_errors.labels(op="read").inc())
    keeper = LeaseKeeper(registry, config.tenant_weights, config.lease_ttl_s,
                         on_error=lambda op: metrics.registry_errors.labels(op=op).inc()).start()
    router = Router(view, keeper, metrics, config)
    metrics.watch_guarantees(lambda: view.snapshot().endpoints, config.tenant_weights)
    try:
        registry.client.ping()
    except redis.RedisError as e:
        log.warning("registry %s not reachable yet (%s); requests fail until it is", redacted(config.redis_url), e)

    lookups = ThreadPoolExecutor(4, thread_name_prefix="capacity")

    def capacity() -> cluster_pb2.GetClusterCapacityResponse:
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
    generate = serving.method_names(service, "Generate")
    admission = serving.Admission(args.max_in_flight, generate,
                                  on_refused=lambda _method: metrics.count(outcomes.REJECTED))
    # Tenants' programs call the router with bearer tokens, not certificates.
    server, port = serving.build_server(config.port, host=config.host, admission=admission, credentials=credentials,
                                        client_certificates=False,
                                        on_refused=serving.counting(generate, metrics.count))
    # The HTTP front forwards each request to this gRPC port: it only translates (and counts what it
    # refuses itself, before forwarding).
    http = (HttpFront(credentials, port, config.host, args.http_port, config.grace_s, on_refused=metrics.count,
                      limits=limits, tenant_limits=tenant_limits) if args.http_port != -1 else None)
    servicer = RouterServicer(router, channels, credentials, write_deadline.WriteDeadline(args.grpc_stall_timeout_s))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    cluster_pb2_grpc.add_ClusterStateServiceServicer_to_server(ClusterStateServicer(capacity, credentials), server)
    health = serving.add_health_and_reflection(server, [
        pb.DESCRIPTOR.services_by_name["TargetService"].full_name,
        cluster_pb2.DESCRIPTOR.services_by_name["ClusterStateService"].full_name,
    ])
    # Over HTTP the per-tenant leases are for operators: those holding the metrics token.
    metrics_server = MetricsHttpServer(
        metrics.registry, config.metrics_port, host=args.metrics_host or config.host, health=health,
        json_routes={"/capacity": lambda operator: capacity_json(
            visible_to(capacity(), None if operator else ""))}, limits=limits,
        open_metrics=serving.metrics_open_from(args))
    metrics_server.start()
    server.start()
    if http is not None:
        http.start()
    health.set_ready(True)
    log.info("serving Router on port %d, metrics on port %d (registry %s, tenant weights %s)",
             port, metrics_server.port, redacted(config.redis_url), config.tenant_weights or "none")
    serving.report_ready("Router", port, metrics_server.port, http_port=http.port if http else None)
    serving.serve_until_signal(server, health, config.grace_s, metrics=metrics_server,
                               on_drain=http.begin_stop if http else None)
    if http is not None:
        http.stop()
    keeper.stop()
    checks.close()
    channels.close()
    lookups.shutdown(wait=False)
    registry.close()
    return 0
