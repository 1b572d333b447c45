"""Plumbing every gRPC server shares: logging, server construction, health, reflection, metrics, drain.

The target service, the speculation endpoint and the router each build a server with `build_server`,
register their servicers, call `add_health_and_reflection`, start a `MetricsHttpServer`
(specpool/common/metrics_http.py), then block in
`serve_until_signal`, which drains in-flight RPCs on SIGTERM (what Kubernetes sends before killing a pod).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specpool.common import errors, http_limits, logs, outcomes, security
from specpool.common.metrics_http import METRICS_TOKEN_ENV

if TYPE_CHECKING:
    from specpool.common.metrics_http import MetricsHttpServer

log = logging.getLogger(__name__)

REDIS_URL_ENV = "SPECPOOL_REDIS_URL"
# Set by cluster/processes.start_server: the pid of the process that launched this server.
LAUNCHER_PID = "SPECPOOL_LAUNCHER_PID"
# Set by a launcher (cluster/processes.py): where a server writes its ports once it serves.
READY_FILE = "SPECPOOL_READY_FILE"
LIVENESS = "liveness"
READINESS = "readiness"
# The largest message any specpool server or client sends or takes. A prompt fits in a few hundred KB
# of text (--max-context tokens); drafts and sparse q are a few KB a round, dense q travels on the
# tensor channel. One limit everywhere: a hop that took more than the next one would only waste work.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MESSAGE_SIZE_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Threads kept for short calls (health, cancel, info, capacity) beyond those admitted streams hold.
CONTROL_WORKERS = 16


def setup_logging(level: str = "INFO", log_format: str | None = None) -> None:
    """Text or JSON lines on stderr (specpool/common/logs.py); log_format None: $SPECPOOL_LOG_FORMAT, else text.
    SIGUSR1 writes every thread's stack to stderr too (`kill -USR1 PID`: where a stuck server waits)."""
    logs.setup(level, log_format)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every server takes for TLS, tokens, the registry's URL (specpool/common/security.py) and
    the limits its HTTP ports hold clients to (specpool/common/http_limits.py)."""
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help=f"ca.crt, tls.crt, tls.key of this service (default: ${security.TLS_DIR_ENV}); a directory "
                        f"with ca.key is a local CA that issues this process its certificate (specpool up)")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext and no authentication: anyone who reaches a port is any tenant (logs a warning)")
    p.add_argument("--metrics-host", default=None,
                   help=f"address /metrics and /capacity listen on (default: --host); with "
                        f"${METRICS_TOKEN_ENV} set they require 'Authorization: Bearer <token>'")
    p.add_argument("--metrics-open", action="store_true",
                   help=f"without ${METRICS_TOKEN_ENV}, serve /metrics (every tenant's figures) to whoever "
                        f"reaches the port: for an in-cluster scrape where a NetworkPolicy guards it (default: "
                        f"/metrics refuses every scrape without the token)")
    p.add_argument("--redis", default=None, metavar="URL",
                   help=f"register in the cluster registry at this Redis (default: ${REDIS_URL_ENV}, else none; "
                        f"prefer the variable: a password in an argument shows in `ps`)")
    http_limits.add_arguments(p)


def security_from(args: argparse.Namespace, role: str, name: str, tokens_file: str | None = None) -> security.Security:
    """This server's credentials from its flags and environment; exits with what to pass if they are missing."""
    try:
        return security.Security.load(args.tls_dir, role, name, insecure=args.insecure, tokens_file=tokens_file)
    except security.SecurityError as e:
        raise SystemExit(str(e)) from e


def metrics_open_from(args: argparse.Namespace) -> bool:
    """Whether /metrics is served without a token: --metrics-open, or --insecure (which turns every check off)."""
    return bool(args.metrics_open or args.insecure)


def redis_url_from(args: argparse.Namespace) -> str | None:
    return args.redis or os.environ.get(REDIS_URL_ENV) or None


def build_server(port: int, host: str = "127.0.0.1", admission: Admission | None = None,
                 credentials: security.Security | None = None,
                 client_certificates: bool = True,
                 on_refused: Callable[[str, str], None] | None = None) -> tuple[grpc.Server, int]:
    """A thread-pool gRPC server bound (not started) on host:port; port 0 picks a free port.

    A sync gRPC server runs each call on a pool thread until it ends. `admission` bounds the long calls
    (its methods); the pool has CONTROL_WORKERS threads more, so health checks, cancels and info calls
    never wait behind generation. With `credentials` every call is TLS and authenticated before a
    servicer sees it; client_certificates=True also requires mutual TLS at the handshake.
    `on_refused(method, outcome)` hears each call refused before a servicer sees it for its credentials
    (unauthenticated) or its bytes (invalid), so that a server can count every request it was sent.
    """
    admission = admission or Admission(64, methods=())
    credentials = credentials or security.Security.insecure()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=admission.limit + CONTROL_WORKERS, thread_name_prefix="grpc"),
        interceptors=[credentials.interceptor(on_refused), MalformedRequests(on_refused), admission],
        options=[
            *MESSAGE_SIZE_OPTIONS,
            # Without this a second server on the same port binds silently and steals half the traffic.
            ("grpc.so_reuseport", 0),
        ],
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound_port = credentials.add_port(server, address, client_certificates=client_certificates)
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind gRPC server to {address}: {e}") from e
    if bound_port == 0:  # older grpcio reports a failed bind this way instead of raising
        raise RuntimeError(f"cannot bind gRPC server to {address}")
    return server, bound_port


class Admission(grpc.ServerInterceptor):
    """At most `limit` calls of `methods` (full names, "/package.Service/Method") at once; the next is
    refused at once with RESOURCE_EXHAUSTED and a retry hint (google.rpc.RetryInfo), instead of queueing
    for a thread the server does not have. `on_refused(method)` hears each refusal (to count it)."""

    def __init__(self, limit: int, methods: Iterable[str], retry_after_s: float = 1.0,
                 on_refused: Callable[[str], None] | None = None):
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.methods = frozenset(methods)
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused
        self._free = threading.BoundedSemaphore(limit)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.methods:
            return handler
        if handler.unary_unary:
            behavior = handler.unary_unary

            def admitted_unary(request, context):
                with self.call(context, method):
                    return behavior(request, context)

            return handler._replace(unary_unary=admitted_unary)
        kind = "unary_stream" if handler.unary_stream else "stream_stream" if handler.stream_stream else None
        if kind is None:
            return handler  # client-streaming unary: none of our APIs has one
        behavior = getattr(handler, kind)

        def admitted_stream(request_or_iterator, context):
            with self.call(context, method):  # held until the response stream ends, however it ends
                yield from behavior(request_or_iterator, context)

        return handler._replace(**{kind: admitted_stream})

    @contextmanager
    def call(self, context: grpc.ServicerContext, method: str = "") -> Iterator[None]:
        if not self._free.acquire(blocking=False):
            if self.on_refused is not None:
                self.on_refused(method)
            abort_with_retry(context, f"request: this server is at its limit of {self.limit} requests in "
                             f"flight; retry in {self.retry_after_s:g} s or on another replica", self.retry_after_s)
        try:
            yield
        finally:
            self._free.release()


def counting(methods: Iterable[str], count: Callable[[str], None]) -> Callable[[str, str], None]:
    """build_server's on_refused that counts the refused calls of `methods` (the requests) by outcome."""
    methods = frozenset(methods)
    return lambda method, outcome: count(outcome) if method in methods else None


def method_names(service, *methods: str) -> list[str]:
    """Full gRPC method names ("/package.Service/Method") of a service descriptor's methods."""
    return [f"/{service.full_name}/{service.methods_by_name[m].name}" for m in methods]


def abort_with_retry(context: grpc.ServicerContext, message: str, retry_after_s: float) -> NoReturn:
    """RESOURCE_EXHAUSTED with google.rpc.RetryInfo: clients and proxies that read status details
    back off by retry_delay; others still have the message (which starts with "request: ")."""
    field, _, rest = message.partition(": ")
    errors.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, field, rest, retry_after_s=retry_after_s)


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the call can say so."""

    def __init__(self, error: Exception):
        self.error = error


class MalformedRequest(ValueError):
    """Raised by a request stream at a message that did not parse, once the call's status is set
    (INVALID_ARGUMENT): a servicer that reads its requests on a thread of its own (the endpoint's Rounds)
    can tell bad input from a bug of its own, and stop reading without a traceback."""


class MalformedRequests(grpc.ServerInterceptor):
    """Bytes that are not the method's request message get INVALID_ARGUMENT, not INTERNAL plus a
    traceback in the server's log (what gRPC does when its deserializer raises). `on_refused(method,
    "invalid")` hears each."""

    def __init__(self, on_refused: Callable[[str, str], None] | None = None):
        self.on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(e)

        def refuse(context, bad: _Malformed) -> NoReturn:
            if self.on_refused is not None:
                self.on_refused(handler_call_details.method, outcomes.INVALID)
            abort_invalid(context, "request", f"not a valid {handler_call_details.method} request message "
                          f"({type(bad.error).__name__}: {bad.error})")

        if handler.unary_unary or handler.unary_stream:
            behavior = handler.unary_unary or handler.unary_stream

            def checked_unary(request, context):
                if isinstance(request, _Malformed):
                    refuse(context, request)
                return behavior(request, context)

            kind = "unary_unary" if handler.unary_unary else "unary_stream"
            return handler._replace(request_deserializer=lenient, **{kind: checked_unary})

        behavior = handler.stream_unary or handler.stream_stream

        def checked_stream(requests, context):
            def each():
                for request in requests:
                    if isinstance(request, _Malformed):
                        try:
                            refuse(context, request)
                        except Exception as aborted:  # context.abort's own, bare: the status is set
                            raise MalformedRequest(f"request: {request.error}") from aborted
                    yield request

            return behavior(each(), context)

        kind = "stream_unary" if handler.stream_unary else "stream_stream"
        return handler._replace(request_deserializer=lenient, **{kind: checked_stream})


class HealthState:
    """grpc.health.v1 statuses: "liveness" (restart me if not serving), "readiness" (send me traffic).

    The overall service "" and each served service by its full name (specpool.v1.TargetService) follow
    readiness, so plain health checkers (grpc_health_probe with or without -service) see a server as
    healthy only once it can take work.
    """

    def __init__(self, servicer: grpc_health.HealthServicer | None = None, services: Iterable[str] = ()):
        self.servicer = servicer or grpc_health.HealthServicer()
        self.services = [grpc_health.OVERALL_HEALTH, *services]
        self._live = False
        self._ready = False
        self.set_live(True)
        self.set_ready(False)

    @property
    def live(self) -> bool:
        return self._live

    @property
    def ready(self) -> bool:
        return self._ready

    def set_live(self, live: bool) -> None:
        self._live = live
        self.servicer.set(LIVENESS, _status(live))

    def set_ready(self, ready: bool) -> None:
        self._ready = ready
        self.servicer.set(READINESS, _status(ready))
        for service in self.services:
            self.servicer.set(service, _status(ready))


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def add_health_and_reflection(server: grpc.Server, service_full_names: list[str]) -> HealthState:
    """Registers grpc.health.v1 (live, not yet ready) and server reflection for the given services.

    The services' generated `_pb2` modules must be imported first: reflection reads the default pool.
    """
    state = HealthState(services=service_full_names)
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    names = [*service_full_names, grpc_health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(list(dict.fromkeys(names)), server)
    return state


def report_ready(service: str, port: int, metrics_port: int, http_port: int | None = None, detail: str = "") -> None:
    """Tell the launcher, if one asked (READY_FILE in the environment), which ports this server took
    (http_port: a router's OpenAI-compatible front, when it runs one) and a line about itself for its
    listing (`detail`): a JSON file written whole, then renamed, so a reader never sees half of it. Logs
    one "ready" line with the same, for log pipelines."""
    report = {"service": service, "port": port, "metrics_port": metrics_port}
    if http_port is not None:
        report["http_port"] = http_port
    if detail:
        report["detail"] = detail
    log.info("ready", extra=report)
    path = os.environ.get(READY_FILE)
    if not path:
        return
    report["pid"] = os.getpid()
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(report, f)
    os.replace(partial, path)


def serve_until_signal(
    server: grpc.Server,
    health: HealthState,
    grace_s: float = 10.0,
    on_drain: Callable[[], None] | None = None,
    metrics: MetricsHttpServer | None = None,
) -> None:
    """Blocks until SIGTERM or SIGINT, then drains: not ready, stop admitting, finish in-flight RPCs.
    A server started by a launcher (cluster/processes.py) also drains once that launcher is gone,
    so a launcher that crashed or was killed leaves no orphaned servers behind.

    Must be called from the main thread (Python delivers signals only there).
    """
    stop = threading.Event()
    launcher = int(os.environ.get(LAUNCHER_PID, "0") or 0)

    def on_signal(signum: int, _frame) -> None:
        if stop.is_set():
            log.info("got %s while draining; still draining", signal.Signals(signum).name)
        else:
            log.info("got %s", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(timeout=1.0):
            if launcher and os.getppid() != launcher:
                log.warning("the process that launched this server (pid %d) is gone", launcher)
                break
        log.info("draining (grace %.1fs)", grace_s)
        health.set_ready(False)
        if on_drain is not None:
            try:
                on_drain()
            except Exception:
                log.exception("on_drain failed; stopping anyway")
        server.stop(grace_s).wait()
        if metrics is not None:
            metrics.stop()
        log.info("stopped")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def abort_invalid(
    context: grpc.ServicerContext,
    field: str,
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    reason: str | None = None,
) -> NoReturn:
    """Ends the RPC with a status whose message starts with the offending field's name, and its details
    (specpool.common.errors)."""
    errors.abort(context, code, field, message, reason=reason)
