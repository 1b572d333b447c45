"""One attachment to a speculation endpoint: the Rounds stream and its reader thread, and the tensor
channel that carries dense q."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from specpool.common.security import Security
from specpool.common.serving import MESSAGE_SIZE_OPTIONS
from specpool.common.speculation import backend_from_pb
from specpool.common.tensor_channel import ChannelOffer, DistributedPairChannel
from specpool.target_service.remote.fallback import DeadlineBreaker
from specpool.target_service.remote.ssd_push import OutcomeTables
from specpool.target_service.remote.wire import capacity_request, tensor_channel_request
from specpool_client.v1 import speculation_pb2 as pb
from specpool_client.v1 import speculation_pb2_grpc

log = logging.getLogger("specpool.target.speculation")


@dataclass(frozen=True)
class Reply:
    response: pb.RoundsResponse
    dense: torch.Tensor | None  # [dense_rows, V] from the tensor channel
    arrived_at: float = field(default_factory=time.monotonic)


class Connection:
    """The stream, its reader thread and the tensor channel. Every reply, awaited or not, is timed
    for the breaker; pushed SSD tables land in `tables`."""

    def __init__(self, address: str, tenant: str, connect_timeout_s: float, breaker: DeadlineBreaker,
                 delay_s: float = 0.0, credentials: Security | None = None):
        self.tenant = tenant
        self.delay_s = delay_s  # injected per message, each way (tests and benchmarks)
        self.breaker = breaker
        self._sent_at: dict[int, float] = {}
        self.tables = OutcomeTables()
        # Only a certificate that names an endpoint (endpoint.specpool) gets this target's contexts.
        self.channel = (credentials or Security.insecure()).channel(address, "endpoint", options=MESSAGE_SIZE_OPTIONS)
        self.stub = speculation_pb2_grpc.SpeculationServiceStub(self.channel)
        self.capacity = self.stub.GetCapacity(capacity_request(), timeout=connect_timeout_s)
        self.broken = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.tensor: DistributedPairChannel | None = None
        self._tensor_ready = threading.Event()
        offer = self.stub.OpenTensorChannel(tensor_channel_request(tenant), timeout=connect_timeout_s)
        threading.Thread(target=self._connect_tensor, args=(offer,), daemon=True).start()
        self._stream = self.stub.Rounds(self._delayed(iter(self._outbox.get, None)))
        threading.Thread(target=self._read, daemon=True, name="spec-reader").start()

    def _connect_tensor(self, offer: pb.OpenTensorChannelResponse) -> None:
        try:
            self.tensor = DistributedPairChannel.connect(
                ChannelOffer(host=offer.store_host, port=offer.store_port, prefix=offer.prefix,
                             backend=backend_from_pb(offer.backend), target_rank=offer.target_rank, timeout_s=offer.timeout_s,
                             secret=offer.secret),
                rank=offer.target_rank,
            )
            self._tensor_ready.set()
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:  # ValueError: an offer with no secret
            # dense q then drafts locally; sparse is unaffected
            log.warning("tensor channel to the endpoint failed: %s", e)

    @property
    def dense_ready(self) -> bool:
        return self._tensor_ready.is_set()

    def _delayed(self, messages):
        for message in messages:
            if self.delay_s:
                time.sleep(self.delay_s)
            yield message

    def _read(self) -> None:
        try:
            for response in self._stream:
                if self.delay_s:
                    time.sleep(self.delay_s)
                if response.tables:
                    self.tables.put(response.tables)
                if not response.round_id:
                    continue  # an unsolicited push
                dense = None
                if response.dense_rows:
                    # Read even when nobody waits any more: the channel must stay in step.
                    dense = self.tensor.recv((response.dense_rows, response.vocab_size), torch.float32)
                with self._lock:
                    box = self._waiting.pop(response.round_id, None)
                    sent_at = self._sent_at.pop(response.round_id, None)
                if sent_at is not None:
                    self.breaker.replied(time.monotonic() - sent_at)
                if box is not None:
                    box.put(Reply(response, dense))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.warning("speculation stream broke: %s %s", e.code().name, e.details())
        except Exception:
            log.exception("speculation stream reader failed")
        finally:
            self.broken.set()
            with self._lock:
                boxes, self._waiting = list(self._waiting.values()), {}
            for box in boxes:
                box.put(None)

    def send(self, request: pb.RoundsRequest) -> None:
        """A round that needs no reply (push mode: every sequence resolved its drafts itself)."""
        self._outbox.put(request)

    def table_for(self, seq_id: str, follows: list[int], timeout_s: float) -> pb.OutcomeTable | None:
        """The pushed table for these outstanding drafts, waiting up to timeout_s for it to arrive."""
        return self.tables.wait_for(seq_id, follows, timeout_s, self.broken)

    def probe(self, request: pb.RoundsRequest) -> None:
        """Send a round nobody waits for: its reply is only timed (see DeadlineBreaker)."""
        with self._lock:
            self._sent_at[request.round_id] = time.monotonic()
        self._outbox.put(request)

    def send_round(self, request: pb.RoundsRequest) -> queue.Queue:
        """Send one round; its reply (None if the stream breaks) arrives in the returned box."""
        box: queue.Queue = queue.Queue(maxsize=1)
        with self._lock:
            self._waiting[request.round_id] = box
            self._sent_at[request.round_id] = time.monotonic()
        if self.broken.is_set():
            box.put(None)
        self._outbox.put(request)
        return box

    def wait_round(self, round_id: int, box: queue.Queue, timeout_s: float) -> Reply | None:
        """The reply from `send_round`, waiting up to timeout_s; None when late or broken."""
        try:
            return box.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            with self._lock:
                self._waiting.pop(round_id, None)
            return None

    def close(self) -> None:
        self._outbox.put(None)
        self.channel.close()
        if self.tensor is not None:
            self.tensor.close()
