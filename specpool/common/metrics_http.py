"""The HTTP side door of every specpool server: Prometheus /metrics, JSON routes (a capacity API),
and the probes /healthz, /livez, /readyz."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import prometheus_client

from specpool.common import security

if TYPE_CHECKING:  # serving.py imports this module: the type only
    from specpool.common.serving import HealthState

log = logging.getLogger(__name__)

METRICS_TOKEN_ENV = "SPECPOOL_METRICS_TOKEN"


class MetricsHttpServer:
    """HTTP side door: GET /metrics (Prometheus text), JSON routes such as a capacity API, and the
    probes /healthz, /livez, /readyz (kubelet's gRPC probes cannot speak TLS).

    With a token (default: $SPECPOOL_METRICS_TOKEN) /metrics and the JSON routes require
    "Authorization: Bearer <token>"; the probes stay open (they tell nothing).
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
    ):
        self.registry = registry
        self.host = host
        self.port = port
        self.json_routes = dict(json_routes or {})
        self.health = health
        self.token = (token if token is not None else os.environ.get(METRICS_TOKEN_ENV)) or None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._httpd is not None:
            raise RuntimeError("MetricsHttpServer already started")
        self._httpd = ThreadingHTTPServer((self.host, self.port), self._handler_class())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"metrics-http:{self.port}", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

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

        class Handler(BaseHTTPRequestHandler):
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
