"""The tensor channel: dense tensors between one target and one speculation endpoint.

gRPC carries ids and sparse distributions; dense draft distributions (and later hidden states) go
over a 2-rank torch.distributed group per (target, endpoint) pair. The group is built straight from
a TCPStore + PrefixStore, never through a global `init_process_group`, so pairs form and break
while the cluster runs. The endpoint owns the store (`ChannelHost`) and hands out a `ChannelOffer`
per peer; the caller ships the offer over gRPC and the peer calls `DistributedPairChannel.connect`.

    endpoint                                     target
    host = ChannelHost("10.0.0.5")
    offer = host.offer("target-a")  --gRPC-->    ch = DistributedPairChannel.connect(offer, offer.target_rank)
    host.get("target-a", 30).send(t)             ch.recv(shape, dtype)

Each offer carries a secret the peer must prove before the pair is used; how a pair forms (the store,
the group, the proof) is specpool.common.channel_pairing's.

`LoopbackChannel.pair()` is the in-process stand-in for tests.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from specpool.common.channel_pairing import (
    WILDCARD_HOSTS,
    PeerRefused,
    check_backend,
    connect_error,
    join_store,
    local_address_towards,
    new_group,
    new_secret,
    prove_secret,
    serve_store,
)
from specpool.engine.runtime.device import default_device, distributed_backend

log = logging.getLogger(__name__)

_TAG = 0


class ChannelError(RuntimeError):
    """The channel is closed or broken (a send failed, the peer went away); make a new pair."""


class ChannelBusy(ChannelError):
    """The host has as many pairs waiting for their peers as it allows; offer again later."""


@runtime_checkable
class PairChannel(Protocol):
    def send(self, tensor: torch.Tensor) -> None:
        """Returns at once; tensors go out in call order. A failure surfaces at the next send()/close()."""

    def recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Blocks for the next tensor, in the order the peer sent them."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class ChannelOffer:
    """What a peer needs to join a pair; travels over gRPC (authenticated: `secret` admits the peer)."""

    host: str
    port: int
    prefix: str
    backend: str
    target_rank: int
    timeout_s: float
    secret: bytes = field(repr=False)  # the pair's; never written into the store, never logged


class DistributedPairChannel:
    """A PairChannel over a 2-rank Gloo (CPU) or NCCL (GPU) group.

    One thread should recv; any thread may send. Each transfer waits at most `timeout_s` for the
    peer (a send waits for the peer to post the matching recv): a peer that falls that far behind
    breaks the channel. On NCCL both directions are ordered on one communicator, so two peers that
    both send large tensors before receiving may stall each other: keep a pair's traffic one-way at a time.
    """

    def __init__(self, backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, store: dist.Store, *,
                 rank: int, device: torch.device, timeout_s: float, name: str):
        self.rank = rank
        self.peer_rank = 1 - rank
        self.device = device
        self.name = name
        self._backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = backend
        self._store = store  # the group reads it lazily (NCCL); keep the TCP connection alive with it
        self._timeout = timedelta(seconds=timeout_s)
        # (snapshot, CUDA event its copy recorded) per send; None tells the sender thread to finish
        self._outbox: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event | None] | None]
        self._outbox = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name=f"tensor-send:{name}", daemon=True)
        self._sender.start()

    @classmethod
    def connect(cls, offer: ChannelOffer, rank: int, device: torch.device | None = None) -> DistributedPairChannel:
        """Joins the pair an endpoint offered; blocks until both ranks are in (or offer.timeout_s passes)."""
        device = device or default_device()
        check_backend(offer.backend, device, offer.prefix)
        if not offer.secret:
            raise ValueError(f"tensor channel {offer.prefix}: the offer carries no pairing secret")
        try:
            store = join_store(offer.host, offer.port, offer.prefix, offer.timeout_s)
        except Exception as e:
            via = f"connecting to the store at {offer.host}:{offer.port}"
            raise connect_error(e, offer.prefix, rank, offer.timeout_s, via) from e
        return cls._join(store, rank=rank, backend=offer.backend, device=device, timeout_s=offer.timeout_s,
                         name=offer.prefix, local_host=local_address_towards(offer.host, offer.port),
                         secret=offer.secret)

    @classmethod
    def _join(cls, store: dist.Store, *, rank: int, backend: str, device: torch.device, timeout_s: float, name: str,
              local_host: str | None, secret: bytes) -> DistributedPairChannel:
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1 in a pair; got {rank}")
        if not secret:
            raise ValueError(f"tensor channel {name}: no pairing secret")
        check_backend(backend, device, name)
        try:
            group = new_group(store, rank, backend, timedelta(seconds=timeout_s), local_host)
        except Exception as e:
            raise connect_error(e, name, rank, timeout_s, "waiting for the peer to join") from e
        channel = cls(group, store, rank=rank, device=device, timeout_s=timeout_s, name=name)
        del group  # the channel holds the only reference: its shutdown closes the sockets
        try:
            prove_secret(secret, rank, channel._send_bytes, channel._recv_bytes)
        except PeerRefused as e:
            log.warning("tensor channel %s: refused the peer at rank %d: it did not prove the pair's secret",
                        name, 1 - rank)
            channel._abort()
            raise ChannelError(f"tensor channel {name}: rank {rank} refused rank {1 - rank}: {e}") from None
        except Exception as e:
            channel._abort()
            raise connect_error(e, name, rank, timeout_s, "handshake") from e
        return channel

    def send(self, tensor: torch.Tensor) -> None:
        self._raise_if_unusable()
        # Snapshot now: the caller may overwrite its buffer while the copy waits in the queue.
        snapshot = tensor.detach().to(device=self.device, memory_format=torch.contiguous_format, copy=True)
        ready = None
        if snapshot.is_cuda:  # the sender thread runs on another stream: it must wait for this copy
            ready = torch.cuda.Event()
            ready.record()
        self._outbox.put((snapshot, ready))

    def recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._closed:
            raise ChannelError(f"tensor channel {self.name} is closed")
        out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        try:
            self._backend.recv([out], self.peer_rank, _TAG).wait(self._timeout)
        except Exception as e:
            what = f"{list(shape)} {dtype}"
            raise ChannelError(f"tensor channel {self.name}: recv of {what} failed: {e}") from e
        return out

    def close(self) -> None:
        """Sends what is queued (each within the timeout), then tears the group down."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)
        self._sender.join(timeout=self._timeout.total_seconds() + 1.0)
        if self._sender.is_alive():
            log.warning("tensor channel %s: queued sends still pending at close; dropping them", self.name)
        self._shutdown()
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            raise ChannelError(f"tensor channel {self.name}: a send failed: {self._error}") from self._error

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            self._error_reported = True
            raise ChannelError(f"tensor channel {self.name}: a send failed: {self._error}") from self._error
        if self._closed:
            raise ChannelError(f"tensor channel {self.name} is closed")

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            if self._error is not None:
                continue  # broken: drop what is still queued
            tensor, ready = item
            try:
                if ready is not None:
                    torch.cuda.current_stream(tensor.device).wait_event(ready)
                self._backend.send([tensor], self.peer_rank, _TAG).wait(self._timeout)
            except Exception as e:
                what = f"{list(tensor.shape)} {tensor.dtype}"
                log.exception("tensor channel %s: send of %s failed", self.name, what)
                self._error = e

    def _send_bytes(self, data: bytes) -> None:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._backend.send([tensor], self.peer_rank, _TAG).wait(self._timeout)

    def _recv_bytes(self, n: int) -> bytes:
        out = torch.zeros(n, dtype=torch.uint8, device=self.device)
        self._backend.recv([out], self.peer_rank, _TAG).wait(self._timeout)
        return bytes(out.cpu().tolist())

    def _abort(self) -> None:
        """Tears the group down without sending anything queued (nothing is, before the handshake)."""
        self._closed = True
        self._outbox.put(None)
        self._shutdown()

    def _shutdown(self) -> None:
        backend, self._backend = self._backend, None
        if backend is None:
            return
        try:
            backend.shutdown()
        except RuntimeError as e:  # the peer may already be gone
            log.debug("tensor channel %s: shutdown: %s", self.name, e)
        # Gloo closes its sockets (and so tells the peer) only when the last reference goes: this was it.


@dataclass
class _Pairing:
    offer: ChannelOffer
    done: threading.Event = field(default_factory=threading.Event)
    channel: DistributedPairChannel | None = None
    dropped: bool = False


class ChannelHost:
    """Endpoint side: one TCPStore server, one pair per peer (rank 0 here, rank 1 at the peer).

    The store listens on `host` only (a wildcard host, "", 0.0.0.0 or ::, means every interface) and
    on `port` (0: an ephemeral one; `self.port` says which); `host` is also the address peers are told
    to reach (and where the Gloo side of each pair listens). Each offer carries its own secret, which
    the peer must prove before the pair is used. At most `max_joining` offers wait for their peers at
    once (each holds a thread for up to timeout_s); more are refused with ChannelBusy.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 device: torch.device | None = None, max_joining: int = 16):
        self.host = host
        self.timeout_s = timeout_s
        self.max_joining = max_joining
        self.device = device or default_device()
        self.backend = distributed_backend(self.device)
        self._store, self._local_host = serve_store(host, port, timeout_s)
        self.port = self._store.port
        self._advertised_host = socket.gethostname() if host in WILDCARD_HOSTS else host
        self._pairings: dict[str, _Pairing] = {}
        self._joining = 0  # offers whose rank 0 still waits for the peer
        self._lock = threading.Lock()
        self._closed = False

    def offer(self, peer: str) -> ChannelOffer:
        """A fresh pair for peer (replacing any earlier one); rank 0 starts joining in the background."""
        # The prefix names no peer: anyone who reaches the store may list its keys.
        offer = ChannelOffer(host=self._advertised_host, port=self.port, prefix=f"pair/{uuid.uuid4().hex}",
                             backend=self.backend, target_rank=1, timeout_s=self.timeout_s, secret=new_secret())
        pairing = _Pairing(offer)
        with self._lock:
            if self._closed:
                raise ChannelError("ChannelHost is closed")
            # Offers nobody joins (a peer that died, a client that only asks) would otherwise hold a
            # thread each: one per call, however many calls.
            if self._joining >= self.max_joining:
                raise ChannelBusy(f"{self._joining} tensor channel offers are waiting for their peers, the most "
                                  f"this endpoint allows; retry within {self.timeout_s:g} s")
            self._joining += 1
            previous = self._pairings.get(peer)
            self._pairings[peer] = pairing
        if previous is not None:
            self._discard(previous)
        threading.Thread(target=self._join, args=(pairing,), name=f"tensor-join:{peer}", daemon=True).start()
        return offer

    def get(self, peer: str, timeout_s: float = 0.0) -> PairChannel | None:
        with self._lock:
            pairing = self._pairings.get(peer)
        if pairing is None:
            return None
        pairing.done.wait(timeout_s)
        with self._lock:
            return pairing.channel

    def drop(self, peer: str) -> None:
        with self._lock:
            pairing = self._pairings.pop(peer, None)
        if pairing is not None:
            self._discard(pairing)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairings = list(self._pairings.values())
            self._pairings.clear()
        for pairing in pairings:
            self._discard(pairing)

    def _join(self, pairing: _Pairing) -> None:
        prefix = pairing.offer.prefix
        channel = None
        try:
            # A connection of its own: waits on one connection take turns, so an offer nobody joins
            # held every later pair up for its whole timeout (50 such offers: 25 minutes).
            store = join_store(self._local_host, self.port, prefix, self.timeout_s)
            channel = DistributedPairChannel._join(
                store, rank=0, backend=self.backend, device=self.device, timeout_s=self.timeout_s, name=prefix,
                local_host=self.host, secret=pairing.offer.secret)
        except ChannelError as e:  # a peer that did not prove the secret: already logged
            log.debug("%s", e)
        except (TimeoutError, RuntimeError) as e:
            log.warning("%s", e)
        finally:
            with self._lock:
                self._joining -= 1
                if channel is not None and not pairing.dropped:
                    pairing.channel, channel = channel, None
            pairing.done.set()
            if channel is not None:  # dropped or replaced while it was joining
                _close_quietly(channel)

    def _discard(self, pairing: _Pairing) -> None:
        with self._lock:
            pairing.dropped = True
            channel, pairing.channel = pairing.channel, None
        if channel is not None:
            _close_quietly(channel)


def _close_quietly(channel: PairChannel) -> None:
    try:
        channel.close()
    except ChannelError as e:  # already logged when the send failed
        log.debug("%s", e)


_PEER_CLOSED = object()


class LoopbackChannel:
    """In-process PairChannel over two queues, for tests and single-process runs."""

    def __init__(self, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue):
        self._inbox = inbox
        self._outbox = outbox
        self._closed = False

    @staticmethod
    def pair() -> tuple[LoopbackChannel, LoopbackChannel]:
        a_to_b: queue.SimpleQueue = queue.SimpleQueue()
        b_to_a: queue.SimpleQueue = queue.SimpleQueue()
        return LoopbackChannel(b_to_a, a_to_b), LoopbackChannel(a_to_b, b_to_a)

    def send(self, tensor: torch.Tensor) -> None:
        if self._closed:
            raise ChannelError("loopback channel is closed")
        self._outbox.put(tensor.detach().clone())

    def recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._closed:
            raise ChannelError("loopback channel is closed")
        item = self._inbox.get()
        if item is _PEER_CLOSED:
            self._inbox.put(item)  # every later recv fails the same way
            raise ChannelError("loopback channel: the peer closed it")
        if tuple(item.shape) != tuple(shape) or item.dtype != dtype:
            sent = f"{list(item.shape)} {item.dtype}"
            raise ChannelError(f"loopback channel: expected {list(shape)} {dtype}, the peer sent {sent}")
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put(_PEER_CLOSED)
