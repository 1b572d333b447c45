"""The HTTP front's guard against slow and greedy clients (specpool/common/http_limits.py): uvicorn's h11
protocol with read deadlines and connection caps, and an event loop that bounds the TLS handshake.

uvicorn has neither a header nor a body read timeout (its keep-alive timer starts only after a first
response) and counts connections only once a request's head has arrived; so a connection is counted
and refused here as it is made, and the head, then the body, must each arrive within its limit.

Caps per tenant (issue 52.1): behind a proxy or NAT every tenant has one address, so the per-address cap
is only a coarse outer bound. A connection waits for its token in a small pool of its own
(--http-max-unauthenticated-connections; when it is full the oldest gives way, so a client that sends its
head promptly always gets in), held to the head's deadline, body included, while it has no token this
front's tokens file lists. Once a request's head names a tenant, the connection is that tenant's: each
tenant holds at most --http-max-connections-per-tenant connections, --http-max-requests-per-tenant
requests in flight and --http-max-streams-per-tenant streams (TenantLimits); past them 429 and close.

A stream whose client stops reading (issue 52.2): once the send buffer is full the response waits; if it
stays full --http-stall-timeout-s, the connection is dropped, which cancels the request's Generate call
(its batch slot is freed and the router and the target count it cancelled) and one log line names the
tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specpool.common import outcomes
from specpool.common.http_limits import ConnectionCounter, HttpLimits, closing_response, refusal_message
from specpool.common.security import TENANT_HEADER, Security
from specpool.router.openai_schema import OpenAIError

log = logging.getLogger("specpool.router.http")

# The kernel's send buffer of each connection, and the transport's (and TLS layer's) before it pauses the
# response: fixed and small (not autotuned to megabytes), so that a client that stops reading fills them,
# and the stall timer starts, within some tens of kilobytes of a stream.
SEND_BUFFER_BYTES = 16 * 1024

# The scope key under which a request that names a tenant carries its RequestShare (to take a stream).
SHARE = "specpool.share"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_connections_per_tenant: int = 128  # open at once under one tenant's token
    max_requests_per_tenant: int = 64  # requests in flight at once under one tenant's token
    max_streams_per_tenant: int = 32  # of them, streamed responses
    max_unauthenticated: int = 256  # connections whose request has not (yet) shown a token this front knows
    stall_timeout_s: float = 10.0  # a response whose send buffer stays full this long is dropped

    def __post_init__(self):
        for flag, value in (("--http-max-connections-per-tenant", self.max_connections_per_tenant),
                            ("--http-max-requests-per-tenant", self.max_requests_per_tenant),
                            ("--http-max-streams-per-tenant", self.max_streams_per_tenant),
                            ("--http-max-unauthenticated-connections", self.max_unauthenticated)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0 < self.stall_timeout_s < float("inf"):
            raise ValueError(f"--http-stall-timeout-s must be > 0, got {self.stall_timeout_s}")


DEFAULT_TENANT_LIMITS = TenantLimits()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_TENANT_LIMITS
    p.add_argument("--http-max-connections-per-tenant", type=int, default=d.max_connections_per_tenant,
                   help="the OpenAI front: connections one tenant (its token) holds at once; past it 429 and close")
    p.add_argument("--http-max-requests-per-tenant", type=int, default=d.max_requests_per_tenant,
                   help="the OpenAI front: requests one tenant has in flight at once; past it 429 and close")
    p.add_argument("--http-max-streams-per-tenant", type=int, default=d.max_streams_per_tenant,
                   help="the OpenAI front: streamed responses one tenant has open at once; past it 429")
    p.add_argument("--http-max-unauthenticated-connections", type=int, default=d.max_unauthenticated,
                   help="the OpenAI front: connections that have not yet shown a known token (each held to "
                        "--http-header-timeout-s, body included); past it the oldest is answered 503 and closed")
    p.add_argument("--http-stall-timeout-s", type=float, default=d.stall_timeout_s,
                   help="the OpenAI front: a response whose client reads nothing this long while its send buffer "
                        "is full is dropped, and its request cancelled")


def from_args(args: argparse.Namespace) -> TenantLimits:
    return TenantLimits(max_connections_per_tenant=args.http_max_connections_per_tenant,
                        max_requests_per_tenant=args.http_max_requests_per_tenant,
                        max_streams_per_tenant=args.http_max_streams_per_tenant,
                        max_unauthenticated=args.http_max_unauthenticated_connections,
                        stall_timeout_s=args.http_stall_timeout_s)


class Shares:
    """What each tenant holds on one front, and the connections still waiting for a token (oldest first).
    Used on the front's event loop only."""

    def __init__(self, limits: TenantLimits, credentials: Security,
                 on_refused: Callable[[str], None] | None = None):
        self.limits, self.credentials, self.on_refused = limits, credentials, on_refused
        self.waiting: collections.OrderedDict[int, GuardedH11Protocol] = collections.OrderedDict()
        self.connections: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.streams: collections.Counter[str] = collections.Counter()

    def tenant_of(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The tenant a request's head names: its bearer token's (None: no token the tokens file lists);
        an --insecure front believes x-specpool-tenant, as its router does."""
        values = dict(headers)
        if not self.credentials.enabled:
            return values.get(TENANT_HEADER.encode(), b"").decode("latin-1") or "anonymous"
        scheme, _, token = values.get(b"authorization", b"").decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or self.credentials.tokens is None:
            return None
        return self.credentials.tokens.tenant_of(token)

    @staticmethod
    def drop(counter: collections.Counter[str], tenant: str) -> None:
        counter[tenant] -= 1
        if counter[tenant] <= 0:
            del counter[tenant]

    def refused(self, outcome: str) -> None:
        if self.on_refused is not None:
            self.on_refused(outcome)


class RequestShare:
    """One tenant's request in flight on the front: released once the app has answered it."""

    def __init__(self, shares: Shares, tenant: str):
        self.shares, self.tenant = shares, tenant
        self.streaming = False
        self.released = False

    def take_stream(self) -> OpenAIError | None:
        """Counts this request as one of its tenant's streams, or returns the 429 refusing it (counted)."""
        limit = self.shares.limits.max_streams_per_tenant
        if self.shares.streams[self.tenant] >= limit:
            self.shares.refused(outcomes.REJECTED)
            return OpenAIError(429, f"this tenant holds too many open streams (--http-max-streams-per-tenant "
                                    f"{limit})", retry_after_s=1.0)
        self.shares.streams[self.tenant] += 1
        self.streaming = True
        return None

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        Shares.drop(self.shares.requests, self.tenant)
        if self.streaming:
            Shares.drop(self.shares.streams, self.tenant)


def refusing_app(status: int, message: str):
    """An ASGI app that answers `status` with an OpenAI-shaped error and closes the connection."""
    body = json.dumps(OpenAIError(status, message).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    if status in (http.HTTPStatus.TOO_MANY_REQUESTS, http.HTTPStatus.SERVICE_UNAVAILABLE):
        headers.append((b"retry-after", b"1"))

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol held to `limits`; `counter` (per address, in total) and `shares` (per
    tenant, and those waiting for a token) are shared by the front's connections."""

    limits: HttpLimits
    counter: ConnectionCounter
    shares: Shares

    @property
    def app(self):
        """What serves the request whose head has just arrived (uvicorn reads this once per request)."""
        return self._admit_request()

    @app.setter
    def app(self, value) -> None:
        self._app = value

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._reading = ""  # what the deadline waits for: "head", "body" or nothing
        self._tenant: str | None = None  # whose connection this is, once a request has named a tenant
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)
        refused = self.counter.admit(self._address)
        self._counted = refused is None
        if refused is not None:
            self._answer_and_close(refused)
        else:
            self._wait_for_token()
            self._expect("head", self.limits.header_timeout_s)  # silence before the first byte counts too

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect("", None)
        self._stalled_after(None)
        if self._counted:
            self._counted = False
            self.counter.release(self._address)
            self._belong_to(None, waiting=False)
        super().connection_lost(exc)

    # -- tenants' shares --

    def _wait_for_token(self) -> None:
        """Joins the connections waiting for a token; when they are at their cap, the oldest gives way."""
        waiting = self.shares.waiting
        while len(waiting) >= self.shares.limits.max_unauthenticated:
            _, oldest = waiting.popitem(last=False)
            oldest._let_go(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections are waiting to send a request "
                           f"with a token (--http-max-unauthenticated-connections "
                           f"{self.shares.limits.max_unauthenticated}): the oldest gave way")
        waiting[id(self)] = self

    def _belong_to(self, tenant: str | None, *, waiting: bool = True) -> None:
        """Moves this connection to `tenant`'s share (None: back among those waiting for a token, or, with
        waiting=False, nowhere: it has closed)."""
        if self._tenant is not None:
            Shares.drop(self.shares.connections, self._tenant)
        else:
            self.shares.waiting.pop(id(self), None)
        self._tenant = tenant
        if tenant is not None:
            self.shares.connections[tenant] += 1
        elif waiting:
            self._wait_for_token()

    def _admit_request(self):
        """The app for the request whose head has just arrived: the front's, counted in its tenant's share;
        without a token the front knows, the front's, uncounted (it answers 401, or 404; the connection
        stays among those waiting, held to its head's deadline); or a 429 past the tenant's caps."""
        shares = self.shares
        tenant = shares.tenant_of(self.scope["headers"])
        if tenant is None:
            if self._tenant is not None:
                self._belong_to(None)
            return self._app
        if tenant != self._tenant:
            limit = shares.limits.max_connections_per_tenant
            if shares.connections[tenant] >= limit:
                shares.refused(outcomes.REJECTED)
                return refusing_app(http.HTTPStatus.TOO_MANY_REQUESTS, "this tenant holds too many connections "
                                    f"(--http-max-connections-per-tenant {limit})")
            self._belong_to(tenant)
        limit = shares.limits.max_requests_per_tenant
        if shares.requests[tenant] >= limit:
            shares.refused(outcomes.REJECTED)
            return refusing_app(http.HTTPStatus.TOO_MANY_REQUESTS, "this tenant has too many requests in flight "
                                f"(--http-max-requests-per-tenant {limit})")
        shares.requests[tenant] += 1
        share = RequestShare(shares, tenant)
        app = self._app

        async def counted(scope, receive, send) -> None:
            scope[SHARE] = share
            try:
                await app(scope, receive, send)
            finally:
                share.release()

        return counted

    # -- a client that stops reading --

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None and not self.transport.is_closing():
            self._stalled_after(self.shares.limits.stall_timeout_s)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stalled_after(None)

    def _stalled_after(self, within_s: float | None) -> None:
        if self._stall is not None:
            self._stall.cancel()
        self._stall = self.loop.call_later(within_s, self._stalled) if within_s is not None else None

    def _stalled(self) -> None:
        self._stall = None
        if self.transport.is_closing():
            return
        path = self.cycle.scope.get("path", "") if self.cycle is not None else ""
        log.warning("tenant %s: the client of %s read nothing for %g s with its send buffer full "
                    "(--http-stall-timeout-s): connection dropped, request cancelled",
                    self._tenant or "(none)", path, self.shares.limits.stall_timeout_s)
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._reading and self.conn.their_state is h11.IDLE:
            self._expect("head", self.limits.header_timeout_s)  # a keep-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.SEND_BODY:
            if self._reading != "body" and self._tenant is None and self._deadline is not None:
                self._reading = "body"  # without a token, the body is held to the head's deadline
            elif self._reading != "body":
                self._expect("body", self.limits.body_timeout_s)
        elif self.conn.their_state is not h11.IDLE:  # the whole request is in (or the connection failed)
            self._expect("", None)

    def _expect(self, reading: str, within_s: float | None) -> None:
        """Wait `within_s` for `reading` ("head", "body"; "": nothing, no deadline)."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._reading = reading
        self._deadline = self.loop.call_later(within_s, self._too_late) if within_s is not None else None

    def _too_late(self) -> None:
        self._deadline = None
        self._let_go(http.HTTPStatus.REQUEST_TIMEOUT, refusal_message(http.HTTPStatus.REQUEST_TIMEOUT, self.limits),
                     body_only=True)

    def _let_go(self, status: int, message: str, body_only: bool = False) -> None:
        """Answers `status` and closes, or just closes once an answer has begun. The app of a request whose
        body it is still reading (any request's, unless `body_only`) hears http.disconnect, and what it
        still sends goes nowhere."""
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._reading == "body" or (not body_only and self.cycle is not None
                                                         and not self.cycle.response_complete) else None
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is not None and cycle.response_started:  # it answered before reading the body: just close
            self.transport.close()
        else:
            self._answer_and_close(status, message)

    def _answer_and_close(self, status: int, message: str | None = None) -> None:
        message = message or refusal_message(status, self.limits)
        self.transport.write(closing_response(status, OpenAIError(status, message).body()))
        self.transport.close()


def guarded_protocol(limits: HttpLimits, tenant_limits: TenantLimits = DEFAULT_TENANT_LIMITS,
                     credentials: Security | None = None,
                     on_refused: Callable[[str], None] | None = None) -> type[GuardedH11Protocol]:
    """The protocol class for one front (uvicorn builds one per connection): its limits, its own counter
    and its tenants' shares (`on_refused(outcome)` hears each request refused past a tenant's cap)."""
    shares = Shares(tenant_limits, credentials or Security.insecure(), on_refused)
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "counter": ConnectionCounter(limits), "shares": shares})


class HandshakeBoundLoop(asyncio.SelectorEventLoop):
    """An event loop whose TLS servers give up on a client's handshake, and on its close_notify once
    the server has closed, after `timeout_s` (asyncio's defaults are 60 s and 30 s, and uvicorn passes
    neither): a client that stalls either is bounded like one that stalls its headers."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self.timeout_s = timeout_s

    async def create_server(self, *args, **kwargs):
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", self.timeout_s)
            kwargs.setdefault("ssl_shutdown_timeout", self.timeout_s)
        return await super().create_server(*args, **kwargs)
