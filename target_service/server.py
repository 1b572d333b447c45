"""`specpool serve-target`: one target model behind the Target API (specpool.v1.TargetService).

Its flags, and the process that loads the model and wires its parts (the remote drafter, the draft
length, the decoder, the scheduler, the heartbeat) and serves them. The servicer is in
target_service.servicer.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from specpool.common import http_limits, logs, outcomes, serving, write_deadline
from specpool.common.metrics_http import MetricsHttpServer
from specpool.common.model_args import DEFAULT_DATASTORE, add_model_args
from specpool.common.serving import (
    Admission,
    add_health_and_reflection,
    add_security_arguments,
    build_server,
    counting,
    method_names,
    redis_url_from,
    report_ready,
    security_from,
    serve_until_signal,
    setup_logging,
)
from specpool.engine.decoding import Decoder
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.policy.costs import batch_sizes_up_to, cached_step_costs
from specpool.engine.runtime.device import off_main_thread
from specpool.engine.runtime.gguf_loader import default_model_path, model_name
from specpool.engine.runtime.model import Llama
from specpool.target_service.draft_length import TargetDraftLength
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.registration import HeartbeatFields, Layout, refresh_without_registry
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.remote.observer import TargetObserver
from specpool.target_service.scheduler import Scheduler
from specpool.target_service.servicer import TargetServicer
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

log = logging.getLogger("specpool.target")


def local_datastore(model: str | None, datastore: str | None) -> str:
    """--datastore's file ('' for none): the shipped datastore holds SmolLM2's token ids, so by default it
    drafts for the default model alone (a Qwen target's n-gram drafts from it were other tokens' ids)."""
    if datastore is not None:
        return datastore
    return "" if model else DEFAULT_DATASTORE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus /metrics port (0 picks)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address gRPC and /metrics listen on (default loopback; 0.0.0.0: every interface)")
    add_model_args(p)
    p.add_argument("--layout-cores", type=int, default=None,
                   help="CPU cores of the whole layout (this target plus the drafter it shares hardware with), "
                        "which plain decoding could use instead: SSD is planned only if predicted faster than "
                        "plain decoding on all of them (default: this target's threads)")
    p.add_argument("--tenant", default=None,
                   help="this service's id towards speculation endpoints and routers (with TLS: the name in its "
                        "certificate, target/<tenant>; default: that name, or target-<port> with --insecure)")
    p.add_argument("--spec-endpoint", default=None, help="HOST:PORT of a speculation endpoint")
    p.add_argument("--spec-deadline-ms", type=float, default=500.0,
                   help="per-step wait for the endpoint's drafts before drafting locally")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a batch slot; more get RESOURCE_EXHAUSTED with a retry hint")
    write_deadline.add_argument(p)
    p.add_argument("--max-requests-per-tenant", type=int, default=0,
                   help="requests one tenant (its router-named tenant, or its certificate's) holds here at once, "
                        "queued, running or still sending; more get RESOURCE_EXHAUSTED with a retry hint, so one "
                        "tenant cannot fill this target (0, the default: no cap; a target several tenants share "
                        "sets it: three quarters of --max-batch leaves the rest of the batch to the others)")
    p.add_argument("--max-context", type=int, default=2048, help="KV positions per sequence")
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="fixed draft length (0: chosen per step by the hardware-aware policy)")
    p.add_argument("--datastore", default=None,
                   help=f"n-gram datastore for local drafting ('' for none; default: {DEFAULT_DATASTORE} with the "
                        "default model, none with another)")
    p.add_argument("--ssd-mode", default="push", choices=["push", "pull"],
                   help="SSD: take drafts from outcome tables the endpoint pushes (push) or ask every round (pull)")
    p.add_argument("--spec-delay-ms", type=float, default=0.0,
                   help="inject this delay into every speculation message, each way (tests, benchmarks)")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    add_security_arguments(p)
    p.add_argument("--advertise-host", default="127.0.0.1", help="host routers reach this service on")
    p.add_argument("--log-level", default="INFO", help="Python logging level: DEBUG, INFO, WARNING or ERROR")
    logs.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    setup_logging(args.log_level, args.log_format)
    if args.max_queue < 0:
        raise SystemExit(f"--max-queue must be >= 0, got {args.max_queue}")
    # Off by default: a cap holds a tenant's burst to it, queued requests included, so a lone tenant would
    # lose a quarter of its batch (fair admission with a reserved share is the fix that would cost nothing).
    per_tenant = args.max_requests_per_tenant
    if per_tenant < 0:
        raise SystemExit(f"--max-requests-per-tenant must be >= 0, got {per_tenant}")
    if args.layout_cores is not None and args.layout_cores < 1:
        raise SystemExit(f"--layout-cores must be >= 1, got {args.layout_cores}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    name = model_name(path)
    credentials = security_from(args, "target", args.tenant or "target")
    tenant = credentials.identity.name if credentials.enabled else args.tenant or f"target-{args.port}"
    if args.tenant and tenant != args.tenant:
        raise SystemExit(f"--tenant {args.tenant!r} is not the name in this service's certificate ({tenant!r}); "
                         "routers and endpoints know it by its certificate")
    metrics = TargetMetrics(name, tenant)

    batch_sizes = batch_sizes_up_to(args.max_batch)  # the step costs of the batches it can run

    def load():
        loading = time.perf_counter()
        model, tokenizer = Llama.from_path(path, dtype=args.dtype, device=args.device)
        log.info("loaded %s as %s%s in %.1f s", name, model.format_label, " (fused kernels)" if model.fused else "",
                 time.perf_counter() - loading)
        costs = None
        if not args.draft_tokens:
            log.info("measuring verify-step costs of %s (cached after the first run)", name)
            costs = cached_step_costs(model, name, batch_sizes=batch_sizes)
        # Read on this thread: its thread count is the one the costs were measured (and keyed) with.
        layout = Layout.of(model, name, torch.get_num_threads(), args.layout_cores, batch_sizes=batch_sizes)
        return model, tokenizer, costs, layout

    # The scheduler thread decodes; torch work on this thread would leave it a second OpenMP pool.
    model, tokenizer, costs, layout = off_main_thread(load)
    datastore = None
    datastore_path = local_datastore(args.model, args.datastore)
    if datastore_path and Path(datastore_path).exists() and tokenizer is not None:
        datastore = SuffixArrayDatastore.load(datastore_path)
    observer = TargetObserver(metrics)
    drafter = RemoteDrafter(
        tenant, name, model.config.vocab_size, args.spec_endpoint, NgramDrafter(datastore), observer,
        deadline_s=args.spec_deadline_ms / 1000, ssd_push=args.ssd_mode == "push",
        delay_s=args.spec_delay_ms / 1000, credentials=credentials,
    )
    draft_length = TargetDraftLength(drafter, costs, fixed=args.draft_tokens)
    decoder = off_main_thread(lambda: Decoder(model, args.max_batch, args.max_context, drafter, draft_length))
    metrics.spec_breaker_open.set_function(lambda: float(drafter.breaker.open))
    metrics.spec_deadline_seconds.set_function(drafter.breaker.deadline)
    scheduler = Scheduler(decoder, drafter, metrics, observer, name, max_queue=args.max_queue)

    # Every admitted request holds a server thread: the running batch plus the queue.
    service = pb.DESCRIPTOR.services_by_name["TargetService"]
    generate = method_names(service, "Generate")
    admission = Admission(args.max_batch + args.max_queue, generate,
                          on_refused=lambda _method: metrics.count(outcomes.REJECTED))
    server, port = build_server(args.port, host=args.host, admission=admission, credentials=credentials,
                                on_refused=counting(generate, metrics.count))
    servicer = TargetServicer(scheduler, tokenizer, model, name, tenant, args.max_context, args.max_batch, drafter,
                              credentials, max_per_tenant=per_tenant,
                              write_deadline=write_deadline.WriteDeadline(args.grpc_stall_timeout_s))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [service.full_name])
    metrics_server = MetricsHttpServer(metrics.registry, args.metrics_port, host=args.metrics_host or args.host,
                                       health=health, limits=http_limits.from_args(args),
                                       open_metrics=serving.metrics_open_from(args))
    metrics_server.start()
    server.start()
    if args.spec_endpoint:
        drafter.wait_attached(5.0)
    health.set_ready(True)
    heartbeat = refreshing = None
    redis_url = redis_url_from(args)
    address = f"{args.advertise_host}:{port}"
    fields = HeartbeatFields(address, name, tenant, args.max_batch, scheduler, decoder, metrics, drafter,
                             draft_length.free, lambda: draft_length.draft_model,
                             ssd_policy_fn=draft_length.ssd_policy, layout=layout, format=model.format_label)
    if redis_url:
        from specpool.common.registry import Heartbeat

        heartbeat = Heartbeat(redis_url, "target", address, fields.fields).start()
    else:
        refreshing = refresh_without_registry(fields.fields)
    log.info("serving TargetService on port %d, metrics on port %d (model %s, tenant %s, endpoint %s)",
             port, metrics_server.port, name, tenant, args.spec_endpoint or "none")
    report_ready("TargetService", port, metrics_server.port,
                 detail=f"{model.format_label}{' (fused kernels)' if model.fused else ''}, "
                        f"ready {time.perf_counter() - started:.1f} s after start")

    def drain() -> None:
        scheduler.accepting = False
        if heartbeat is not None:
            heartbeat.stop()  # routers stop sending new work at once
        if refreshing is not None:
            refreshing.set()

    serve_until_signal(server, health, args.grace_s, on_drain=drain, metrics=metrics_server)
    scheduler.stop()
    drafter.close()
    return 0
