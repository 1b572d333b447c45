"""The limits every specpool HTTP surface holds slow and greedy clients to: the router's OpenAI-compatible
front (router/http_guard.py) and every server's /metrics side door (specpool/common/metrics_http.py).

Without them 150 connections sending their headers a byte at a time stayed open indefinitely (issue 38.3).
Answers follow HTTP's conventions, each with `Connection: close`: 408 when a request's head or body does not
arrive in time, 429 when one client address already holds its share of connections, 503 when the surface
holds its total; an idle keep-alive connection is closed without a word.
"""

from __future__ import annotations

import argparse
import http
import json
import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # a request's head: from the connection's start (or the next request's first byte)
    body_timeout_s: float = 30.0  # a request's body: from the end of its head (4 MiB at 140 KB/s)
    idle_timeout_s: float = 5.0  # a keep-alive connection between requests
    max_connections: int = 1024  # open at once on one surface
    # open at once from one client address: a coarse outer bound, high enough for a proxy or NAT that all
    # tenants share (the OpenAI front caps each tenant, router/http_guard.py)
    max_connections_per_client: int = 512

    def __post_init__(self):
        for flag, value in (("--http-header-timeout-s", self.header_timeout_s),
                            ("--http-body-timeout-s", self.body_timeout_s),
                            ("--http-idle-timeout-s", self.idle_timeout_s)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be > 0, got {value}")
        for flag, value in (("--http-max-connections", self.max_connections),
                            ("--http-max-connections-per-client", self.max_connections_per_client)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


DEFAULT_LIMITS = HttpLimits()


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = DEFAULT_LIMITS
    p.add_argument("--http-header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help="every HTTP port (the OpenAI front, /metrics): a request's head must arrive within this "
                        "of the connection's start or of its first byte, else 408 and close")
    p.add_argument("--http-body-timeout-s", type=float, default=defaults.body_timeout_s,
                   help="a request's body must arrive within this of its head, else 408 and close")
    p.add_argument("--http-idle-timeout-s", type=float, default=defaults.idle_timeout_s,
                   help="a keep-alive connection idle this long between requests is closed")
    p.add_argument("--http-max-connections", type=int, default=defaults.max_connections,
                   help="connections one HTTP port holds at once; past it a new one gets 503 and is closed")
    p.add_argument("--http-max-connections-per-client", type=int, default=defaults.max_connections_per_client,
                   help="connections one client address holds on one HTTP port; past it 429 and close (a coarse "
                        "outer bound: behind a proxy every client has its address; the OpenAI front also caps "
                        "each tenant, --http-max-connections-per-tenant)")


def from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(header_timeout_s=args.http_header_timeout_s, body_timeout_s=args.http_body_timeout_s,
                      idle_timeout_s=args.http_idle_timeout_s, max_connections=args.http_max_connections,
                      max_connections_per_client=args.http_max_connections_per_client)


class ConnectionCounter:
    """The connections one surface holds, in total and per client address (thread-safe)."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._by_client: Counter[str] = Counter()
        self._total = 0

    def admit(self, client: str) -> int | None:
        """Counts a new connection from `client` and returns None, or returns the status refusing it
        (then it is not counted)."""
        with self._lock:
            if self._total >= self.limits.max_connections:
                return http.HTTPStatus.SERVICE_UNAVAILABLE
            if self._by_client[client] >= self.limits.max_connections_per_client:
                return http.HTTPStatus.TOO_MANY_REQUESTS
            self._by_client[client] += 1
            self._total += 1
            return None

    def release(self, client: str) -> None:
        with self._lock:
            self._total -= 1
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]


def refusal_message(status: int, limits: HttpLimits) -> str:
    """Why a connection or request was refused, naming the flag that set the limit."""
    return {
        http.HTTPStatus.REQUEST_TIMEOUT: "the request did not arrive in time (--http-header-timeout-s "
                                         f"{limits.header_timeout_s:g}, --http-body-timeout-s {limits.body_timeout_s:g})",
        http.HTTPStatus.TOO_MANY_REQUESTS: "this client address holds too many connections "
                                           f"(--http-max-connections-per-client {limits.max_connections_per_client})",
        http.HTTPStatus.SERVICE_UNAVAILABLE: "this server holds too many connections "
                                             f"(--http-max-connections {limits.max_connections})",
    }[status]


def closing_response(status: int, body: dict) -> bytes:
    """A whole HTTP/1.1 response with a JSON body that closes its connection (429 and 503 ask the client to
    wait a second)."""
    content = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(content)}", "connection: close"]
    if status in (http.HTTPStatus.TOO_MANY_REQUESTS, http.HTTPStatus.SERVICE_UNAVAILABLE):
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + content
