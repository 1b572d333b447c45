"""One client call's forwarding state: the upstream call of its current route, and what it has streamed.

A `Stream` remembers what the client already has, so that another replica can continue it; a
`Forwarding` ties one route's upstream call to the client's call and ends the route exactly once:
`finish` when the request ends on it (Router.finish counts the request), `hand_over` when another
replica continues it.
"""

from __future__ import annotations

import threading
import uuid

import grpc

from specpool.router.routing import Route, Router
from specpool_client.v1 import target_pb2 as pb


class Forwarding:
    """One route's upstream call: cancelled when the client's call ends, ended exactly once; counted in
    the in-flight gauge until then."""

    def __init__(self, router: Router, route: Route):
        self.router = router
        self.route = route
        self.handed_over = False
        self._call = None
        self._cancelled = False
        self._finished = False
        self._lock = threading.Lock()
        router.metrics.in_flight.labels(model=route.model).inc()

    def attach(self, call) -> None:
        with self._lock:
            self._call = call
            cancelled = self._cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def finish(self, outcome: str) -> None:
        """The request ended on this route: its slot is released and the request counted with `outcome`."""
        if self._end():
            self.router.finish(self.route, outcome)

    def hand_over(self) -> None:
        """Another replica continues the request: this route's slot is released, the request not counted."""
        if not self._end():
            return
        self.handed_over = True
        self.router.release(self.route)

    def _end(self) -> bool:
        """True the first time only."""
        with self._lock:
            if self._finished:
                return False
            self._finished = True
        self.router.metrics.in_flight.labels(model=self.route.model).dec()
        return True


class Stream:
    """What one call has streamed to its client, so that another replica can continue it."""

    def __init__(self, request: pb.GenerateRequest):
        if not request.request_id:  # one id for every replica the request visits, so Cancel finds it
            request = copy_request(request)
            request.request_id = uuid.uuid4().hex
        self.request = request
        self.tokens: list[int] = []  # delivered token ids (of the one completion when movable)
        self.text = ""
        self.sent_any = False
        self.final_sent = False
        self.cancelled = False  # its final says every completion was cancelled (a Cancel reached its replica)
        self.refused: grpc.RpcError | None = None  # the last replica's RESOURCE_EXHAUSTED, if it was full

    def sent(self, msg: pb.GenerateResponse) -> None:
        self.sent_any = True
        if msg.HasField("delta"):
            self.tokens.extend(msg.delta.token_ids)
            self.text += msg.delta.text
        else:
            self.final_sent = True
            self.cancelled = bool(msg.final.completions) and all(
                c.finish_reason == pb.FINISH_REASON_CANCELLED for c in msg.final.completions)

    def movable(self) -> bool:
        # n > 1 streams interleave completions, which a replica cannot resume: once anything was sent
        # such a stream fails with its replica, as it did before migration existed.
        return not self.sent_any or self.request.n <= 1

    def next_request(self) -> pb.GenerateRequest | None:
        """The request to place: the original until tokens were delivered, then its continuation;
        None when nothing is left to generate (see final)."""
        if not self.tokens:
            return self.request
        remaining = self.request.max_tokens - len(self.tokens)
        if remaining < 1 or self.tokens[-1] in self.request.stop_token_ids:
            return None
        resumed = copy_request(self.request)
        resumed.resume_token_ids.extend(self.tokens)
        resumed.max_tokens = remaining
        return resumed

    def final(self, model: str) -> pb.GenerateResponse:
        """The final message when the replica died between the last token and its final message, from
        what was streamed: no speculation statistics, prompt_tokens only for prompt_ids. (A model's own
        end-of-sequence token is not known here; a stream cut right after one is continued.)"""
        stopped = self.tokens[-1] in self.request.stop_token_ids
        token_ids = [*self.request.resume_token_ids, *self.tokens]
        return pb.GenerateResponse(request_id=self.request.request_id, final=pb.GenerateResult(
            request_id=self.request.request_id, model=model,
            completions=[pb.Completion(index=0, token_ids=token_ids, text=self.text,
                                       finish_reason=pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)],
            usage=pb.Usage(prompt_tokens=len(self.request.prompt_ids.ids), completion_tokens=len(token_ids))))


def copy_request(request: pb.GenerateRequest) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    return out

