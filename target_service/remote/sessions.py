"""Per-sequence session bookkeeping on the target's side: what each sequence holds open on the
endpoint, and its opening and closing (the outcome tables an endpoint pushes for SSD are in ssd_push.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch

from specpool.engine.plan import SpeculationPlan
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.remote.wire import close_sessions_request, open_sessions_request, session_spec

if TYPE_CHECKING:
    from specpool.target_service.remote.connection import Connection

log = logging.getLogger("specpool.target.speculation")


@dataclass
class Session:
    """One sequence, as the remote drafter knows it."""

    context: list[int]  # prompt and every emitted token: what a re-opened session starts from
    params: SamplingParams
    plan: SpeculationPlan
    opened: bool = False  # a session for it is open on the current endpoint connection
    opening: bool = False  # an OpenSessions call for it is in flight
    opened_at: int = 0  # len(context) when that call was sent
    retry_at: float = 0.0  # after a declined open (capacity), when to ask again
    drafts: list[int] = field(default_factory=list)  # the drafts it verifies now (SSD: what tables follow)
    cache_lookups: int = 0  # SSD rounds with an outcome to look up
    cache_hits: int = 0
    pending: list[int] = field(default_factory=list)  # emitted since its last round was sent
    # The target's features at every context position but the last, as float16 chunks, for a session whose
    # drafter may read them (a head's; SSD's with a head). None: not kept.
    features: list[torch.Tensor] | None = None
    reads_features: bool = False  # the endpoint session's drafter reads them: each round sends its new rows
    unsent: list[torch.Tensor] = field(default_factory=list)  # chunks the endpoint session has not had yet

    def keep_features(self, features: torch.Tensor | None) -> None:
        """features [n, d] of the n tokens just added to the context (float16: half the bytes, and the
        drafter normalises them; values past float16's range saturate)."""
        if self.features is None or features is None:
            return
        chunk = features.detach().float().clamp(-65504.0, 65504.0).to(torch.float16).cpu()
        self.features.append(chunk)
        self.unsent.append(chunk)

    def take_unsent(self) -> torch.Tensor | None:
        """The feature rows the endpoint session still needs, marked sent; None when it reads none."""
        if not self.reads_features or not self.unsent:
            return None
        rows, self.unsent = torch.cat(self.unsent), []
        return rows


class Sessions:
    """The sequences of one target, keyed by seq_id, and their sessions on the attached endpoint:
    opened lazily and without stalling a step, closed in one call per step."""

    def __init__(self, tenant: str, target_model: str, lease_s: float, push: bool, reattach_s: float):
        self.tenant = tenant
        self.target_model = target_model
        self.lease_s = lease_s
        self.push = push  # SSD: the endpoint pushes outcome tables
        self.reattach_s = reattach_s  # after a declined open, the wait before asking again
        self.seqs: dict[str, Session] = {}
        self._opens: list[tuple[Connection, list[str], grpc.Future]] = []
        self._to_close: list[str] = []
        self._closing: list[grpc.Future] = []

    def __getitem__(self, seq_id: str) -> Session:
        return self.seqs[seq_id]

    def get(self, seq_id: str) -> Session | None:
        return self.seqs.get(seq_id)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.seqs

    def add(self, seq_id: str, session: Session) -> None:
        self.seqs[seq_id] = session

    def remove(self, seq_id: str) -> Session | None:
        """Forgets it; its endpoint session closes with the next flush."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and (seq.opened or seq.opening):
            self._to_close.append(seq_id)
        return seq

    def close(self, seq_id: str) -> None:
        """Keeps the sequence, drafted on the target from now on; its endpoint session closes with the
        next flush (one whose open is still in flight, once that lands)."""
        seq = self.seqs[seq_id]
        if seq.opened:
            self._to_close.append(seq_id)
        seq.opened, seq.features, seq.unsent, seq.reads_features = False, None, [], False

    def flush_closes(self, conn: Connection | None) -> None:
        """One CloseSessions for every sequence that left (fire and forget: leases back it up)."""
        ids, self._to_close = self._to_close, []
        # Hold the futures until done: grpc cancels a call whose future is garbage-collected.
        self._closing = [f for f in self._closing if not f.done()]
        if ids and conn is not None and not conn.broken.is_set():
            self._closing.append(conn.stub.CloseSessions.future(close_sessions_request(self.tenant, ids)))

    def open(self, conn: Connection, seq_ids: list[str], wait_s: float, timeout_s: float) -> bool:
        """Opens sessions for new (or re-attached) sequences, waiting at most wait_s: a slow open
        leaves its sequences drafting locally until it lands, never stalls the step. False when the
        endpoint is gone (the caller detaches)."""
        now = time.monotonic()
        closed = [s for s in seq_ids if not (self.seqs[s].opened or self.seqs[s].opening)
                  and self.seqs[s].retry_at <= now]
        if closed:
            specs = []
            for s in closed:
                seq = self.seqs[s]
                seq.opening, seq.opened_at = True, len(seq.context)
                specs.append(session_spec(s, seq.context, seq.plan, seq.params, self.push))
            future = conn.stub.OpenSessions.future(
                open_sessions_request(self.tenant, self.target_model, self.lease_s, specs), timeout=timeout_s,
            )
            self._opens.append((conn, closed, future))
            try:
                future.result(timeout=wait_s)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # collected below or on a later step
        return self._collect_opens(conn)

    def _collect_opens(self, current: Connection) -> bool:
        pending, alive = [], True
        for conn, seq_ids, future in self._opens:
            if not future.done():
                pending.append((conn, seq_ids, future))
                continue
            for seq in (self.seqs[s] for s in seq_ids if s in self.seqs):
                seq.opening = False
            if conn is not current:
                continue  # opened on a connection we have since dropped
            try:
                reply = future.result()
            except grpc.RpcError as e:
                log.warning("OpenSessions failed: %s %s", e.code().name, e.details())
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    alive = False
                continue
            for opened in reply.sessions:
                seq = self.seqs.get(opened.request_id)
                if seq is None:
                    continue
                if not seq.plan.remote:  # moved off the endpoint while this open was in flight
                    if opened.ok:
                        self._to_close.append(opened.request_id)
                    continue
                seq.opened = opened.ok
                if opened.ok:
                    seq.pending = seq.context[seq.opened_at :]  # emitted while the open was in flight
                    # Its first round sends the features of the whole context (but the last token).
                    seq.reads_features = opened.reads_features and seq.features is not None
                    seq.unsent = list(seq.features or [])
                else:
                    seq.retry_at = time.monotonic() + self.reattach_s
                    log.debug("endpoint declined %s: %s", opened.request_id, opened.error)
        self._opens = pending
        return alive

    def detached(self) -> None:
        """The endpoint connection is gone: every sequence re-opens, with its full context, on the next."""
        for seq in self.seqs.values():
            seq.opened, seq.opening, seq.pending = False, False, []
