"""Continuous batching for one target model: requests queue, join the running batch when a slot
frees, and stream their tokens out as each step accepts them.

One scheduler thread owns the Decoder (and so the model and KV cache); gRPC handler threads only
submit requests and read their event queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specpool.common import outcomes
from specpool.engine.decoding import Decoder, GenerationResult
from specpool.engine.plan import SpeculationPlan
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.remote.observer import SequenceCounts, TargetObserver

log = logging.getLogger("specpool.target.scheduler")


@dataclass
class Request:
    request_id: str  # the caller's id, which its responses carry
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: list[int] | None
    speculation: SpeculationPlan
    n: int = 1
    resumed: list[int] = field(default_factory=list)  # completion tokens a failed replica already streamed (n 1)
    events: queue.Queue = field(default_factory=queue.Queue)  # ("delta", index, tokens) / ("done", None, None)
    results: list[GenerationResult] = field(default_factory=list)
    counts: list[SequenceCounts] = field(default_factory=list)  # per completion
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False
    expired: bool = False  # cancelled because its client's deadline passed
    owner: str = ""  # who submitted it (target_service/servicer.py): ids are unique per owner only

    @property
    def key(self) -> str:
        """The id within this service: another owner's request of the same id is another request."""
        return request_key(self.owner, self.request_id)

    def seq_id(self, index: int) -> str:
        return f"{self.key}/{index}"


def request_key(owner: str, request_id: str) -> str:
    return f"{len(owner)}:{owner}/{request_id}"


class Scheduler:
    """Requests onto the Decoder's batch: queueing, admission, cancellation, and their tokens out.
    The Decoder steps the batch; this decides which requests are in it and runs its thread."""

    def __init__(self, decoder: Decoder, drafter: RemoteDrafter, metrics: TargetMetrics,
                 observer: TargetObserver, model_name: str, max_queue: int = 1024):
        self.decoder = decoder
        self.drafter = drafter
        self.metrics = metrics
        self.observer = observer  # counts each admitted sequence's fallbacks and SSD cache use
        self.model_name = model_name
        self.max_queue = max_queue
        self._inbox: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._by_seq: dict[str, tuple[Request, int]] = {}
        self._cancel: set[str] = set()
        self._wake = threading.Condition()
        self._stop = False
        self.accepting = True
        metrics.running.set_function(lambda: self.load()[0])  # read at each scrape, mid-step included
        metrics.queued.set_function(lambda: self.load()[1])
        metrics.max_batch.set(decoder.cache.max_slots)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
        self._thread.start()

    # -- called from gRPC threads -------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._wake:
            if not self.accepting:
                raise RuntimeError("draining: this target service is shutting down")
            # Requests in the inbox that free slots will take at the next step are not waiting.
            if len(self._inbox) >= self.max_queue + max(0, self.decoder.free_slots):
                raise OverflowError(f"queue full ({self.max_queue} requests waiting for a batch slot)")
            if request.key in self._running or any(r.key == request.key for r in self._inbox):
                raise KeyError(request.request_id)
            self._inbox.append(request)
            self._wake.notify()

    def cancel(self, key: str) -> bool:
        """key: Request.key (the owner's scope and its id)."""
        with self._wake:
            known = key in self._running or any(r.key == key for r in self._inbox)
            if known:
                self._cancel.add(key)
                self._wake.notify()
            return known

    def load(self) -> tuple[int, int]:
        """(running sequences, queued requests)."""
        return len(self._by_seq), len(self._inbox)

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5)

    # -- the scheduler thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self._cancel and not self.decoder.has_work:
                    self._wake.wait()
                if self._stop:
                    return
                cancels, self._cancel = self._cancel, set()
            try:
                self._apply_cancels(cancels)
                self._admit()
                if self.decoder.has_work:
                    start = time.perf_counter()
                    moved = self.decoder.step()
                    step_s = time.perf_counter() - start
                    self.metrics.step_seconds.observe(step_s)
                    if self.decoder.last_verify_s is not None:  # a decode step (a prefill verifies nothing)
                        self.metrics.verify_seconds.observe(self.decoder.last_verify_s)
                        self.metrics.round_seconds.observe(step_s)
                    self._deliver(moved)
            except Exception:
                log.exception("scheduler step failed; failing the running requests")
                self._fail_all()

    def _apply_cancels(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            with self._wake:
                queued = [r for r in self._inbox if r.key == rid]
                for r in queued:
                    self._inbox.remove(r)
            for r in queued:
                r.cancelled = True
                self.metrics.queue_wait.observe(time.monotonic() - r.submitted_at)
                self._finish(r)
            request = self._running.get(rid)
            if request is not None:
                request.cancelled = True
                for i in range(request.n):
                    self.decoder.cancel(request.seq_id(i))
                self._finish(request)

    def _admit(self) -> None:
        while True:
            with self._wake:
                if not self._inbox or self._inbox[0].n > self.decoder.free_slots:
                    return
                request = self._inbox.popleft()
            self.metrics.admitted(request, time.monotonic())
            request.counts = [SequenceCounts() for _ in range(request.n)]
            for i in range(request.n):
                seq_id = request.seq_id(i)
                request.results.append(self.decoder.add(seq_id, request.prompt_ids + request.resumed, request.params,
                                                        request.max_tokens, request.stop_ids, request.speculation))
                self._by_seq[seq_id] = (request, i)
                self.observer.follow(seq_id, request.counts[i])
            self._running[request.key] = request

    def _deliver(self, moved: list[tuple[str, list[int]]]) -> None:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq_id, tokens in moved:
            request, index = self._by_seq[seq_id]
            touched[request.key] = request
            if tokens:
                if request.first_token_at is None:
                    request.first_token_at = now
                    self.metrics.ttft.observe(now - request.submitted_at)
                request.events.put(("delta", index, tokens))
        # Only after every delta of this step is queued: a request may finish several sequences at once.
        for request in touched.values():
            failed = next((r for r in request.results if r.finish_reason == "error"), None)
            if failed is not None:
                log.warning("request %s failed: %s", request.request_id, failed.error,
                            extra={"request_id": request.request_id, "tenant": request.owner.partition("/")[2]})
                for i in range(request.n):
                    self.decoder.cancel(request.seq_id(i))
                request.events.put(("error", None, f"decoding failed: {failed.error}"))
                self._finish(request)
            elif all(r.finish_reason for r in request.results):
                self._finish(request)

    def _finish(self, request: Request) -> None:
        if self._running.pop(request.key, None) is not None or request.finished_at is None:
            request.finished_at = time.monotonic()
            for i in range(request.n):
                self._by_seq.pop(request.seq_id(i), None)
                self.observer.unfollow(request.seq_id(i))
            self.metrics.observe_request(request)
            request.events.put(("done", None, None))

    def _fail_all(self) -> None:
        for request in list(self._running.values()):
            for i in range(request.n):
                self.decoder.cancel(request.seq_id(i))
                self.observer.unfollow(request.seq_id(i))
            request.events.put(("error", None, "internal error in the target's decode step; see its log"))
            self._running.pop(request.key, None)
            self.metrics.count(outcomes.ERROR)
        self._by_seq.clear()
