"""The HTTP front's guard against slow and greedy clients (specpool/common/http_limits.py): uvicorn's h11
protocol with read deadlines and connection caps, and an event loop that bounds the TLS handshake.

uvicorn has neither a header nor a body read timeout (its keep-alive timer starts only after a first
response) and counts connections only once a request's head has arrived; so a connection is counted
and refused here as it is made, and the head, then the body, must each arrive within its limit.
"""

from __future__ import annotations

import asyncio
import http

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specpool.common.http_limits import ConnectionCounter, HttpLimits, closing_response, refusal_message
from specpool.router.openai_schema import OpenAIError


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol held to `limits`; `counter` is shared by the front's connections."""

    limits: HttpLimits
    counter: ConnectionCounter

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        self._deadline: asyncio.TimerHandle | None = None
        self._reading = ""  # what the deadline waits for: "head", "body" or nothing
        refused = self.counter.admit(self._address)
        self._counted = refused is None
        if refused is not None:
            self._answer_and_close(refused)
        else:
            self._expect("head", self.limits.header_timeout_s)  # silence before the first byte counts too

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect("", None)
        if self._counted:
            self._counted = False
            self.counter.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._reading and self.conn.their_state is h11.IDLE:
            self._expect("head", self.limits.header_timeout_s)  # a keep-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.SEND_BODY:
            if self._reading != "body":
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
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._reading == "body" else None
        if cycle is not None:  # the app hears http.disconnect; what it still sends goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is not None and cycle.response_started:  # it answered before reading the body: just close
            self.transport.close()
        else:
            self._answer_and_close(http.HTTPStatus.REQUEST_TIMEOUT)

    def _answer_and_close(self, status: int) -> None:
        self.transport.write(closing_response(status, OpenAIError(status, refusal_message(status, self.limits)).body()))
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one front (uvicorn builds one per connection): its limits and its own counter."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "counter": ConnectionCounter(limits)})


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
