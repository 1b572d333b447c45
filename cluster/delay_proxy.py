"""A slow link on loopback: a TCP proxy that holds every chunk `delay_s` before passing it on, each
way. The delay can be changed while connections live (a link that turns slow, then recovers), and
it is latency, not bandwidth: chunks in flight overlap, as on a long link.

Used by the tests and benchmarks of grey failures (issue 13): point a target's --spec-endpoint at
`proxy.address` instead of the endpoint's.
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    def __init__(self, upstream: str, delay_s: float = 0.0):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                held: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(src, held), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, held), daemon=True).start()

    def _read(self, src: socket.socket, held: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            held.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    @staticmethod
    def _write(dst: socket.socket, held: queue.Queue) -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:  # the other side closed: pass the close on
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return
