"""A deadline on each write of a server-streaming gRPC call: a client that stops reading is cut off.

gRPC's sync server sends a stream's messages one at a time and takes the next only when the last one
was sent; a client that stops reading while its HTTP/2 window is full (a small window is the client's
own choice) holds that send, so the call, its server thread and whatever it reserved (a target's batch
slot, a tenant's share) would wait for as long as the client likes. Each message a call yields is timed
from the yield until gRPC takes the next; past the deadline the call is cancelled, which ends it as if
its client had gone (the server's termination callbacks run: a target cancels the request) and frees
the thread. The HTTP front has the same rule, --http-stall-timeout-s (router/http_guard.py).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grpc-stall-timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="a streaming call whose client has not taken a message for this long (its flow-control "
                        "window full) is cancelled, freeing what it holds")


class WriteDeadline:
    """One watcher thread for every stream of a server (started at the first stream)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"--grpc-stall-timeout-s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.clock = clock
        self._due: dict[int, tuple[float, Callable[[], None]]] = {}  # a write waiting: (its deadline, on_stall)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def stream(self, messages: Iterator[T], on_stall: Callable[[], None]) -> Iterator[T]:
        """`messages`, each timed from its yield until the next is asked for; `on_stall` is called once,
        from the watcher thread, if one is not taken within the deadline (it should cancel the call)."""
        for message in messages:
            write = self._arm(on_stall)
            try:
                yield message
            finally:
                with self._lock:
                    self._due.pop(write, None)

    def _arm(self, on_stall: Callable[[], None]) -> int:
        write = next(self._ids)
        with self._lock:
            self._due[write] = (self.clock() + self.timeout_s, on_stall)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="write-deadline", daemon=True)
                self._watcher.start()
        return write

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            now = self.clock()
            with self._lock:
                stalled = [write for write, (due, _) in self._due.items() if due <= now]
                calls = [self._due.pop(write)[1] for write in stalled]
            for on_stall in calls:
                try:
                    on_stall()
                except Exception:  # one call's cancel failing must not stop the watcher for the others
                    log.exception("cancelling a stalled stream failed")
