"""The HTTP side door of every specpool server: Prometheus /metrics, JSON routes (a capacity API),
and the probes /healthz, /livez, /readyz; held to the server's HttpLimits (specpool/common/http_limits.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import prometheus_client

from specpool.common import security
from specpool.common.http_limits import (
    DEFAULT_LIMITS,
    ConnectionCounter,
    HttpLimits,
    closing_response,
    refusal_message,
)

if TYPE_CHECKING:  # serving.py imports this module: the type only
    from specpool.common.serving import HealthState

log = logging.getLogger(__name__)

METRICS_TOKEN_ENV = "SPECPOOL_METRICS_TOKEN"
# What a refused /metrics scrape is told: /metrics names every tenant, so it is open only when asked to be.
NO_TOKEN_MESSAGE = (f"/metrics needs the metrics token, and this server has none: set {METRICS_TOKEN_ENV} "
                    f"in its environment and send 'Authorization: Bearer <token>', or start it with "
                    f"--metrics-open where a NetworkPolicy admits only the scraper to this port")


class MetricsHttpServer:
    """HTTP side door: GET /metrics (Prometheus text), JSON routes such as a capacity API, and the
    probes /healthz, /livez, /readyz (kubelet's gRPC probes cannot speak TLS).

    With a token (default: $SPECPOOL_METRICS_TOKEN) /metrics and the JSON routes require
    "Authorization: Bearer <token>"; the probes stay open (they tell nothing). Without one, /metrics
    (every tenant's figures) answers 401 unless open_metrics (--metrics-open: the in-cluster scrape where
    a NetworkPolicy guards the port), and the JSON routes answer as to a caller without the token.
    A JSON route may take the caller's standing: route(authorized) gets True when a token is set and
    was presented, so it can leave out what only operators may read.
    """

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry,
        port: int,
        host: str = "127.0.0.1",
        json_routes: dict[str, Callable[[bool], dict]] | None = None,
        health: HealthState | None = None,
        token: str | None = None,
        limits: HttpLimits = DEFAULT_LIMITS,
        open_metrics: bool = False,
    ):
        self.registry = registry
        self.host = host
        self.port = port
        self.json_routes = dict(json_routes or {})
        self.health = health
        self.token = (token if token is not None else os.environ.get(METRICS_TOKEN_ENV)) or None
        self.limits = limits
        self.open_metrics = open_metrics
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._httpd is not None:
            raise RuntimeError("MetricsHttpServer already started")
        self._httpd = _GuardedHttpServer((self.host, self.port), self._handler_class(), self.limits)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"metrics-http:{self.port}", daemon=True
        )
        self._thread.start()
        if self.token:
            access = "requires the metrics token"
        elif self.open_metrics:
            access = f"is open to whoever reaches the port (--metrics-open, no {METRICS_TOKEN_ENV})"
        else:
            access = f"refuses every scrape: set {METRICS_TOKEN_ENV}, or pass --metrics-open"
        log.info("metrics on http://%s:%d/metrics: /metrics %s", self.host, self.port, access)

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._httpd = None
        self._thread = None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        registry = self.registry
        routes = self.json_routes
        health = self.health
        token = self.token
        limits = self.limits
        open_metrics = self.open_metrics

        class Handler(BaseHTTPRequestHandler):
            timeout = limits.header_timeout_s  # each read and write: a client that stops reading is let go too

            def setup(self) -> None:
                super().setup()
                self._head = threading.Lock()
                self._head_state = "reading"  # then "read" (in time) or "late"
                self._deadline = threading.Timer(limits.header_timeout_s, self._too_late)
                self._deadline.daemon = True
                self._deadline.start()

            def parse_request(self) -> bool:  # reads the headers: the head is then in
                parsed = super().parse_request()
                with self._head:
                    if self._head_state == "late":
                        return False
                    self._head_state = "read"
                self._deadline.cancel()
                return parsed

            def _too_late(self) -> None:
                """408 and close, however far the head had come (the handler's read then ends)."""
                with self._head:
                    if self._head_state != "reading":
                        return
                    self._head_state = "late"
                body = {"error": refusal_message(408, limits)}
                with contextlib.suppress(OSError):
                    self.connection.sendall(closing_response(408, body))
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            def finish(self) -> None:
                self._deadline.cancel()
                super().finish()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path in ("/healthz", "/livez", "/readyz"):
                    up = health is None or (health.ready if path == "/readyz" else health.live)
                    self._reply(200 if up else 503, "text/plain; charset=utf-8", b"ok" if up else b"not ready")
                    return
                if path not in routes and path != "/metrics":
                    self._reply(404, "application/json", json.dumps({"error": f"no route {path}"}).encode())
                    return
                if not security.check_metrics_token(self.headers.get("Authorization"), token):
                    self._reply(401, "application/json",
                                b'{"error": "send Authorization: Bearer <the metrics token>"}')
                    return
                if path == "/metrics" and not token and not open_metrics:
                    self._reply(401, "application/json", json.dumps({"error": NO_TOKEN_MESSAGE}).encode())
                    return
                if path == "/metrics":
                    body = prometheus_client.generate_latest(registry)
                    self._reply(200, prometheus_client.CONTENT_TYPE_LATEST, body)
                else:
                    try:
                        body, code = json.dumps(routes[path](token is not None)), 200
                    except Exception as e:
                        log.exception("JSON route %s failed", path)
                        body, code = json.dumps({"error": f"{type(e).__name__}: {e}"}), 500
                    self._reply(code, "application/json", body.encode())

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep them quiet
                log.debug("%s " + format, self.address_string(), *args)

        return Handler


class _GuardedHttpServer(ThreadingHTTPServer):
    """A thread per connection, as many as HttpLimits allows in total and per client address; past them
    a connection gets 503 or 429 from the accepting thread and is closed."""

    daemon_threads = True
    request_queue_size = 1024  # socketserver's 5 would drop a burst of connections before they are counted

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: HttpLimits):
        self.limits = limits
        self.connections = ConnectionCounter(limits)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address) -> None:
        refused = self.connections.admit(client_address[0])
        if refused is not None:
            with contextlib.suppress(OSError):
                request.sendall(closing_response(refused, {"error": refusal_message(refused, self.limits)}))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release(client_address[0])
            raise

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release(client_address[0])

    def handle_error(self, request, client_address) -> None:
        """A client that went away, or was let go, is no error of ours."""
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("metrics connection from %s: %s", client_address[0], sys.exc_info()[1])
        else:
            log.exception("metrics request from %s failed", client_address[0])
