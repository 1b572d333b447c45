"""`specpool serve-spec`: the SpeculationService servicer and the process around it.

The servicer only translates: protobuf -> domain (wire) -> Endpoint -> protobuf. FieldErrors
become statuses whose message starts with the field name; the server keeps serving.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from specpool.common import http_limits, logs, serving
from specpool.common.errors import FieldError
from specpool.common.metrics_http import MetricsHttpServer
from specpool.common.model_args import drafter_arg
from specpool.common.security import Security
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.chunked_models import MODELS
from specpool.spec_endpoint import wire
from specpool.spec_endpoint.drafters import TREE_SHAPE, DrafterSpec, HostedDrafters, LoadOptions
from specpool.spec_endpoint.endpoint import Endpoint, EndpointConfig
from specpool_client.v1 import speculation_pb2 as pb
from specpool_client.v1 import speculation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpeculationService"].full_name


def _abort(context: grpc.ServicerContext, error: FieldError):
    serving.abort_invalid(context, error.field, error.message, getattr(grpc.StatusCode, error.code.value))


class SpeculationServicer(pb_grpc.SpeculationServiceServicer):
    """The tenant of every call is the caller's certificate name (a target's is its service id); the
    requests' `tenant` fields count only on an --insecure endpoint. Sessions and tensor channels are
    keyed by tenant, so one tenant's ids never reach another's sessions: they are just unknown."""

    def __init__(self, endpoint: Endpoint, credentials: Security | None = None):
        self.endpoint = endpoint
        self.credentials = credentials or Security.insecure()

    def _tenant(self, context, claimed: str) -> str:
        caller = self.credentials.caller(context)
        return wire.tenant_from(claimed) if caller.anonymous else caller.name

    @logs.request_scoped
    def OpenSessions(self, request, context):
        try:
            tenant = self._tenant(context, request.tenant)
            logs.tag(request_id=_only(s.request_id for s in request.sessions), tenant=tenant)
            opened = self.endpoint.open_sessions(wire.open_request_from(request, self.endpoint.config.max_len, tenant))
            return wire.open_response_to(opened)
        except FieldError as e:
            _abort(context, e)

    @logs.request_scoped
    def CloseSessions(self, request, context):
        try:
            tenant = self._tenant(context, request.tenant)
        except FieldError as e:
            _abort(context, e)
        logs.tag(request_id=_only(request.request_ids), tenant=tenant)
        return pb.CloseSessionsResponse(closed=self.endpoint.close_sessions(tenant, list(request.request_ids)))

    @logs.request_scoped
    def Rounds(self, request_iterator, context) -> Iterator[pb.RoundsResponse]:
        caller = self.credentials.caller(context)
        tenant = None if caller.anonymous else caller.name
        logs.tag(tenant=tenant)  # a target's stream carries the rounds of all its requests: no request id
        stream = self.endpoint.open_stream()
        context.add_callback(stream.cancel)
        reader = threading.Thread(  # in this call's logging context: its lines name the tenant too
            target=contextvars.copy_context().run, args=(self._read_rounds, request_iterator, stream, tenant),
            name="spec-rounds-reader", daemon=True,
        )
        reader.start()
        try:
            while True:
                item = stream.outbound.get()
                if item is None:
                    return
                if isinstance(item, FieldError):
                    _abort(context, item)
                yield wire.round_response_to(item)
        finally:
            self.endpoint.forget_stream(stream)

    def _read_rounds(self, request_iterator, stream, tenant: str | None) -> None:
        """Feeds the stream's rounds into the shared engine queue until the client half-closes.
        tenant: the caller's (None: --insecure, each round names its own)."""
        try:
            for msg in request_iterator:
                try:
                    self.endpoint.submit(stream, self.endpoint.receive_features(wire.round_from(msg, tenant)))
                except FieldError as e:
                    stream.fail(e)
                    break  # still ended below: the batcher forgets the stream (its round clock) there
        except grpc.RpcError:
            pass  # the client went away; its sessions live on until their leases end
        except serving.MalformedRequest:
            pass  # the call already ends with INVALID_ARGUMENT, which names the request
        except Exception:
            log.exception("Rounds reader failed")
        self.endpoint.end_stream(stream)

    @logs.request_scoped
    def OpenTensorChannel(self, request, context):
        try:
            tenant = self._tenant(context, request.tenant)
            logs.tag(tenant=tenant)
            return wire.channel_response_to(self.endpoint.offer_channel(tenant))
        except FieldError as e:
            _abort(context, e)

    def GetCapacity(self, request, context):
        """A target or a tenant's client sees its own tenant's figures; operators' tools, routers and
        endpoints see every tenant's (Identity.tenant_scope)."""
        caller = self.credentials.caller(context)
        return wire.capacity_to(self.endpoint.capacity(), only=caller.tenant_scope)


def _only(request_ids) -> str | None:
    """The request id of a call about one request; None for a batch (its lines name the tenant alone)."""
    ids = list(request_ids)
    return ids[0] if len(ids) == 1 else None


def capacity_route(endpoint: Endpoint) -> Callable[[bool], dict]:
    """GET /capacity: the per-tenant figures for operators alone (those who sent the metrics token)."""
    return lambda operator: wire.capacity_json(endpoint.capacity(), only=None if operator else "")


def add_to_server(server: grpc.Server, endpoint: Endpoint, credentials: Security | None = None) -> serving.HealthState:
    """Registers the servicer, health (live, not yet ready) and reflection on a built server."""
    pb_grpc.add_SpeculationServiceServicer_to_server(SpeculationServicer(endpoint, credentials), server)
    return serving.add_health_and_reflection(server, [SERVICE_NAME])


def tree_shape(text: str) -> TreeShape:
    """`BRANCH,BEAM,DEPTH` (--tree-shape), each >= 1."""
    try:
        branch, beam, depth = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BRANCH,BEAM,DEPTH, e.g. 4,4,8") from None
    if min(branch, beam, depth) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each of BRANCH,BEAM,DEPTH must be >= 1")
    return TreeShape(branch, beam, depth)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address gRPC and /metrics listen on (default loopback; 0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=50060, help="gRPC port (0: pick a free one)")
    parser.add_argument("--metrics-port", type=int, default=9460, help="Prometheus /metrics port (0: pick)")
    parser.add_argument(
        "--drafter", action="append", type=drafter_arg, default=[],
        metavar="NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]",
        help="drafters for one target model (repeatable; the target and a draft model file may be short names, "
             f"as serve-target's --model: {', '.join(MODELS)}); `default` (and no flag): SmolLM2-135M-Instruct with "
             "models/smollm2-135m-draft, models/smollm2-135m-head and models/smollm2-135m-datastore.npz",
    )
    parser.add_argument("--max-sessions", type=int, default=64, help="sessions (and draft KV slots per model)")
    parser.add_argument("--max-sessions-per-tenant", type=int, default=0,
                        help="sessions one tenant may hold; further opens are refused per session (0: no cap "
                             "below --max-sessions; set it when tenants share the endpoint)")
    parser.add_argument("--max-len", type=int, default=2048,
                        help="tokens per session, every drafter kind (context plus reported tokens; the draft "
                             "model's KV positions): a longer context is refused, a session that grows past it closed")
    parser.add_argument("--ssd-sessions", type=int, default=16, help="SSD sessions per model")
    parser.add_argument("--ssd-fork-slots", type=int, default=128, help="KV slots for SSD forks per model")
    parser.add_argument("--ssd-fork-budget", type=int, default=16,
                        help="most forks per session per round (it starts at half and uses as many as fit "
                             "in the targets' verify time)")
    parser.add_argument("--saguaro-c", type=float, default=1.0,
                        help="Saguaro rescaling of the draft's top tokens when sampling (1: none; lower: more hits)")
    parser.add_argument("--ssd-backup", default="auto", choices=["auto", "neural", "fast"],
                        help="on a cache miss: draft now (neural), n-gram (fast), or chosen from measurements")
    parser.add_argument("--tree-shape", type=tree_shape, default=TREE_SHAPE, metavar="BRANCH,BEAM,DEPTH",
                        help="the token trees of tree sessions: children per expanded node, nodes expanded per "
                             f"level, levels (default: {TREE_SHAPE.branch},{TREE_SHAPE.beam},{TREE_SHAPE.max_depth})")
    parser.add_argument("--suffix-store-tokens", type=int, default=50_000,
                        help="n-gram sessions draft from an online suffix store of their tenant's recent prompts and "
                             "outputs, of at most this many tokens per tenant (about 2 KB each; 0: none)")
    parser.add_argument("--suffix-stores", type=int, default=16,
                        help="suffix stores per model; beyond, the least recently used tenant's is dropped")
    parser.add_argument("--share-suffix-store", action="append", default=[], metavar="TENANT",
                        help="this tenant opts in to one suffix store shared with every other tenant named here "
                             "(repeatable; a tenant not named never reads or shapes another's drafts)")
    parser.add_argument("--lease-s", type=float, default=30.0, help="idle session lease when the target sends 0")
    parser.add_argument("--max-lease-s", type=float, default=120.0,
                        help="the longest idle session lease; longer requested leases are clamped to it")
    parser.add_argument("--max-round-streams", type=int, default=64,
                        help="Rounds streams at once (one per attached target); another target is refused with "
                             "RESOURCE_EXHAUSTED and drafts locally until it can attach. Also the tensor channel "
                             "offers that may wait for their peers at once")
    parser.add_argument("--tenant-labels", type=int, default=64,
                        help="tenants named in metric labels: the first this many to open a session; later "
                             "ones are counted under tenant=\"_other\"")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="draft models' weights (auto: Q8_0 blocks through the engine's CPU kernels where "
                             "they build, else bf16 where the device computes it natively, else fp32)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    parser.add_argument("--channel-host", default="127.0.0.1",
                        help="address targets reach this endpoint's tensor-channel store on (its store "
                             "listens there only; 0.0.0.0 or :: for every interface)")
    parser.add_argument("--channel-port", type=int, default=0,
                        help="port of the tensor-channel store (default 0: an ephemeral one); a fixed port so "
                             "a NetworkPolicy can name it")
    parser.add_argument("--endpoint-id", default="", help="name in the capacity API (default: host:port)")
    # 150: two Qwen2.5-Coder 1.5B targets drafting with the 0.5B take turns on 2 cores, their rounds ~140 ms
    # apart; at 50 ms no step waited for the other's, so none shared a forward (1.04 draft forwards a target
    # token with one target and with two), at 150 they fell into step (0.86), each target at 1.07x its speedup
    # alone instead of 0.88x (Intel Xeon, 2 cores, bench sd-remote-x2:4).
    parser.add_argument("--batch-window-ms", type=float, default=150.0,
                        help="the longest a draft step waits for another busy tenant's expected round, to share "
                             "one forward (also at most half the arriving stream's round period; 0: never wait)")
    serving.add_security_arguments(parser)
    parser.add_argument("--advertise-host", default="127.0.0.1", help="host targets and routers reach this on")
    parser.add_argument("--log-level", default="INFO", help="Python logging level: DEBUG, INFO, WARNING or ERROR")
    logs.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import torch

    from specpool.common.tensor_channel import ChannelHost
    from specpool.engine.runtime.device import default_device, off_main_thread

    serving.setup_logging(args.log_level, args.log_format)
    for flag, value in (("--max-sessions", args.max_sessions), ("--max-len", args.max_len), ("--lease-s", args.lease_s),
                        ("--max-lease-s", args.max_lease_s), ("--max-round-streams", args.max_round_streams),
                        ("--suffix-stores", args.suffix_stores)):
        if value <= 0:
            raise SystemExit(f"{flag} must be > 0; got {value}")
    for flag, value in (("--max-sessions-per-tenant", args.max_sessions_per_tenant),
                        ("--tenant-labels", args.tenant_labels), ("--suffix-store-tokens", args.suffix_store_tokens)):
        if value < 0:
            raise SystemExit(f"{flag} must be >= 0; got {value}")
    if args.lease_s > args.max_lease_s:
        raise SystemExit(f"--lease-s {args.lease_s} exceeds --max-lease-s {args.max_lease_s}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    specs = [DrafterSpec.parse(text) for text in args.drafter] or [DrafterSpec.default()]
    for spec in specs:
        for path in (spec.target_gguf, spec.draft_dir, spec.head_dir, spec.datastore):
            if path is not None and not Path(path).exists():
                raise SystemExit(f"--drafter {spec.name}: {path} does not exist")
    ssd = {"max_sequences": args.ssd_sessions, "fork_slots": args.ssd_fork_slots, "fork_budget": args.ssd_fork_budget,
           "saguaro_c": args.saguaro_c, "backup": args.ssd_backup}
    # The engine thread drafts; torch work on this thread would leave it a second OpenMP pool.
    options = LoadOptions(args.max_sessions, args.max_len, device, ssd=ssd, dtype=args.dtype, tree_shape=args.tree_shape,
                          suffix_tokens=args.suffix_store_tokens, suffix_stores=args.suffix_stores,
                          suffix_shared=frozenset(args.share_suffix_store))
    drafters = off_main_thread(lambda: HostedDrafters.load(specs, options))

    # Each attached target's Rounds stream holds a server thread for as long as it is attached.
    rounds = serving.method_names(pb.DESCRIPTOR.services_by_name["SpeculationService"], "Rounds")
    credentials = serving.security_from(args, "endpoint", args.endpoint_id or "endpoint")
    if credentials.enabled and args.endpoint_id and args.endpoint_id != credentials.identity.name:
        raise SystemExit(f"--endpoint-id {args.endpoint_id!r} is not the name in this endpoint's certificate "
                         f"({credentials.identity.name!r}); routers know it by its certificate")
    server, port = serving.build_server(args.port, host=args.host, credentials=credentials,
                                        admission=serving.Admission(args.max_round_streams, rounds))
    config = EndpointConfig(
        max_sessions=args.max_sessions, max_sessions_per_tenant=args.max_sessions_per_tenant, max_len=args.max_len,
        lease_s=args.lease_s, max_lease_s=args.max_lease_s, tenant_labels=args.tenant_labels,
        endpoint_id=args.endpoint_id or (credentials.identity.name if credentials.enabled
                                         else f"{socket.gethostname()}:{port}"),
        batch_window_s=args.batch_window_ms / 1000,
    )
    channels = ChannelHost(host=args.channel_host, port=args.channel_port, device=device,
                           max_joining=args.max_round_streams)
    endpoint = Endpoint(drafters, config, channel_host=channels)
    health = add_to_server(server, endpoint, credentials)
    metrics = MetricsHttpServer(endpoint.metrics.registry, args.metrics_port, host=args.metrics_host or args.host,
                                health=health, json_routes={"/capacity": capacity_route(endpoint)},
                                limits=http_limits.from_args(args), open_metrics=serving.metrics_open_from(args))
    metrics.start()
    endpoint.start()
    server.start()
    heartbeat = None
    redis_url = serving.redis_url_from(args)
    if redis_url:
        from specpool.common.registry import Heartbeat
        from specpool.spec_endpoint.registration import heartbeat_fields

        address = f"{args.advertise_host}:{port}"
        heartbeat = Heartbeat(redis_url, "endpoint", config.endpoint_id,
                              lambda: heartbeat_fields(endpoint.capacity(), address)).start()
    log.info("serving SpeculationService on port %d, metrics on port %d", port, metrics.port)
    serving.report_ready("SpeculationService", port, metrics.port)
    health.set_ready(True)

    def drain() -> None:
        if heartbeat is not None:
            heartbeat.stop()  # routers stop leasing its slots at once
        endpoint.drain()

    try:
        serving.serve_until_signal(server, health, on_drain=drain, metrics=metrics)
    finally:
        endpoint.stop()  # also closes the tensor channels
    return 0

