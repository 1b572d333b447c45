"""Slow HTTP clients against a router's OpenAI front (issue 38.3), measured at the router's limits as
given (default: its defaults): connections that send their head a byte at a time, their body a byte
at a time, or nothing after the TLS handshake, spread over client addresses (127.0.0.N) within the
per-client cap, while a normal request (GET /v1/models with a token) is timed meanwhile.

    python -m specpool.bench.slow_http_clients --json bench/results/slow_http_clients.json

Figures per kind: how many were answered 408, and seconds from each connection's opening to its close
(min, max). Before issue 38.3 all 150 were still open after 75 s. tests/router/test_openai_http.py
runs the same clients (these helpers) against 1-2 s limits.

`--same-address` adds issue 52.1's case on the same router (`same_address`): the slow connections all
from one address, half trickling bodies under mallory's token, while alpha, from that address too, sends
8 requests; it fails unless alpha is served 8 of 8 and every slow connection closes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from specpool.cluster.processes import start_server
from specpool.cluster.redis_server import start_redis
from specpool.common.machine import machine_info, machine_line
from specpool.common.security import LocalCA

TRICKLE_S = 0.2  # a slow client sends its next byte this often
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: router.specpool\r\nx-slow: "  # then "a" after "a"
SLOW_BODY = b"POST /v1/completions HTTP/1.1\r\nhost: router.specpool\r\ncontent-length: 100000\r\n\r\n{"
OPENINGS = {"head": SLOW_HEAD, "body": SLOW_BODY, "silent": b""}
TIMED_OUT = b"HTTP/1.1 408 Request Timeout"


def opening(kind: str, token: str | None = None) -> bytes:
    """What a slow client of `kind` sends first: a body's head carries `token` when given (a tenant's
    slow upload); a head that never ends carries none (its token would never be read)."""
    if kind == "body" and token:
        return SLOW_BODY.replace(b"content-length:", f"authorization: Bearer {token}\r\ncontent-length:".encode())
    return OPENINGS[kind]


def connect(port: int, client: str, tls: ssl.SSLContext | None, receive_buffer: int | None = None) -> socket.socket:
    """A connection to 127.0.0.1:port from the loopback address `client` (TLS as the router's front speaks it).
    `receive_buffer`: its SO_RCVBUF, set before it connects (what a client that never reads holds of a stream)."""
    sock = socket.socket()
    try:
        sock.settimeout(10)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.bind((client, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:  # refused, or nothing listening: closed here, as create_connection would
        sock.close()
        raise
    return tls.wrap_socket(sock, server_hostname="router.specpool") if tls is not None else sock


@dataclass
class SlowClient:
    sock: socket.socket
    trickles: bool  # sends one more byte of its request every TRICKLE_S (else: nothing more)
    opened_at: float = 0.0
    received: bytes = b""
    closed_at: float | None = None

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def read(self) -> None:
        try:
            while data := self.sock.recv(65536):
                self.received += data
            self.closed_at = time.monotonic()
        except (ssl.SSLWantReadError, BlockingIOError):
            pass
        except OSError:  # reset: what came before it was read
            self.closed_at = time.monotonic()


def trickle_until_closed(clients: list[SlowClient], within_s: float) -> list[SlowClient]:
    """Each client sends a byte every TRICKLE_S until the server answers it; returns those the server has
    not closed within `within_s`."""
    end = time.monotonic() + within_s
    with selectors.DefaultSelector() as selector:
        for c in clients:
            c.sock.setblocking(False)
            selector.register(c.sock, selectors.EVENT_READ, c)
        while any(not c.closed for c in clients) and time.monotonic() < end:
            for c in clients:
                if c.trickles and not c.received and not c.closed:
                    with contextlib.suppress(OSError):
                        c.sock.send(b"a")
            for key, _ in selector.select(timeout=TRICKLE_S):
                key.data.read()
                if key.data.closed:
                    selector.unregister(key.fileobj)
    for c in clients:
        c.sock.close()
    return [c for c in clients if not c.closed]


def open_slow_clients(port: int, count: int, per_address: int, first_address: int,
                      tls: ssl.SSLContext | None, kinds: tuple[str, ...] = tuple(OPENINGS),
                      token: str | None = None) -> tuple[dict[str, list[SlowClient]], int]:
    """`count` slow clients, `kinds` in turn, `per_address` from each of 127.0.0.<first_address>... (the
    bodies under `token`, when given); also how many the server let go before their opening was sent
    (a loaded machine)."""
    clients: dict[str, list[SlowClient]] = {kind: [] for kind in kinds}
    let_go = 0
    for i in range(count):
        kind = kinds[i % len(kinds)]
        opened_at = time.monotonic()
        try:
            sock = connect(port, f"127.0.0.{first_address + i // per_address}", tls)
            sock.sendall(opening(kind, token))
        except OSError:
            let_go += 1
            continue
        clients[kind].append(SlowClient(sock, trickles=bool(OPENINGS[kind]), opened_at=opened_at))
    return clients, let_go


def timed_request(port: int, tls: ssl.SSLContext, token: str, client: str = "127.0.0.1") -> tuple[float, bytes]:
    """GET /v1/models as a tenant from `client`: seconds to its whole reply, and the reply's status line
    (empty: the connection was refused or reset without one)."""
    began = time.monotonic()
    try:
        sock = connect(port, client, tls)
    except OSError:
        return time.monotonic() - began, b""
    reply = b""
    with contextlib.suppress(OSError):  # a refusal may close the connection before the request is sent
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nhost: router.specpool\r\nauthorization: Bearer {token}\r\n"
                     f"connection: close\r\n\r\n".encode())
    with contextlib.suppress(OSError):
        while data := sock.recv(65536):
            reply += data
    sock.close()
    return time.monotonic() - began, reply.split(b"\r\n", 1)[0]


def same_address(port: int, tls: ssl.SSLContext, mallory: str, alpha: str, count: int = 150, requests: int = 8,
                 within_s: float = 75.0, address: str = "127.0.0.1") -> dict:
    """Issue 52.1: `count` slow connections from `address`, half trickling bodies under mallory's token and
    half trickling heads without one, while alpha, from the same address, sends `requests` requests
    (GET /v1/models) a quarter second apart. Alpha's statuses, what mallory's connections were answered,
    and how many of them were still open after `within_s`."""
    clients, let_go = open_slow_clients(port, count, count, int(address.rsplit(".", 1)[1]), tls,
                                        kinds=("body", "head"), token=mallory)
    every = [c for group in clients.values() for c in group]
    served: list[tuple[float, bytes]] = []

    def alpha_requests() -> None:
        for _ in range(requests):
            served.append(timed_request(port, tls, alpha, address))
            time.sleep(0.25)

    alpha_thread = threading.Thread(target=alpha_requests, daemon=True)
    alpha_thread.start()
    still_open = trickle_until_closed(every, within_s)
    alpha_thread.join(within_s)
    answers = Counter(c.received.split(b"\r\n", 1)[0].decode(errors="replace") or "closed" for c in every)
    return {"connections": count, "address": address, "let_go_before_opening": let_go,
            "still_open_after_s": {"seconds": within_s, "connections": len(still_open)},
            "mallory_answers": dict(answers),
            "alpha": {"requests": requests, "served": sum(s.startswith(b"HTTP/1.1 200") for _, s in served),
                      "statuses": [s.decode(errors="replace") for _, s in served],
                      "seconds_max": round(max((t for t, _ in served), default=0.0), 3)}}


def measure(count: int, per_address: int, router_args: list[str], within_s: float, same: bool = False) -> dict:
    """The slow clients spread over addresses, a normal request timed meanwhile; with `same`, then
    `same_address`'s case (issue 52.1) on the same router: mallory and alpha on one address."""
    ca = LocalCA.temporary()
    tls = ssl.create_default_context(cafile=str(ca.dir / "ca.crt"))
    token = ca.token("bench")
    redis = start_redis()
    router = None
    try:
        router = start_server("router", ["serve-router", "--port", "0", "--metrics-port", "0", "--redis", redis.url,
                                         *router_args], env=ca.env)
        began = time.monotonic()
        clients, let_go = open_slow_clients(router.http_port, count, per_address, 10, tls)
        opened_s = time.monotonic() - began
        request_s, status = timed_request(router.http_port, tls, token)
        every = [c for group in clients.values() for c in group]
        still_open = trickle_until_closed(every, within_s)
        kinds = {}
        for kind, group in clients.items():
            closed = [c.closed_at - c.opened_at for c in group if c.closed]
            kinds[kind] = {"connections": len(group), "answered_408": sum(c.received.startswith(TIMED_OUT) for c in group),
                           "closed_after_s": [round(min(closed), 2), round(max(closed), 2)] if closed else None}
        figures = {"connections": count, "per_address": per_address, "router_args": router_args,
                   "opened_in_s": round(opened_s, 2), "let_go_before_opening": let_go,
                   "still_open_after_s": {"seconds": within_s, "connections": len(still_open)},
                   "meanwhile": {"status": status.decode(), "seconds": round(request_s, 3)}, "kinds": kinds}
        if same:
            figures["same_address"] = same_address(router.http_port, tls, ca.token("mallory"), ca.token("alpha"),
                                                   count, within_s=within_s)
        return figures
    finally:
        if router is not None:
            router.stop()
        redis.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=150)
    parser.add_argument("--per-address", type=int, default=50, help="slow connections from each client address")
    parser.add_argument("--within-s", type=float, default=75.0, help="how long to wait for the server to close them")
    parser.add_argument("--router-args", default="", help="further serve-router flags, e.g. '--http-header-timeout-s 5'")
    parser.add_argument("--same-address", action="store_true",
                        help="then the same number of slow connections from one address under mallory's token and "
                             "none, while alpha, from that address too, is served (issue 52.1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    figures = measure(args.connections, args.per_address, args.router_args.split(), args.within_s, args.same_address)
    report = {"command": "python -m specpool.bench.slow_http_clients " + " ".join(
        f"--{k.replace('_', '-')} {v!r}" if k == "router_args" else f"--{k.replace('_', '-')}" if v is True
        else f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json" and v is not False),
        "machine": machine_info(), **figures}
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    same = figures.get("same_address")
    failed = figures["still_open_after_s"]["connections"] or (
        same is not None and (same["still_open_after_s"]["connections"] or same["alpha"]["served"] < same["alpha"]["requests"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
