"""SSD on the target's side: the outcome tables an endpoint pushes (one per sequence, covering each likely
outcome of its outstanding drafts), the drafts a step finds in them without a round trip, and SSD's hit
counts, which the draft-length policy charges rounds by."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specpool.engine.drafters.base import accepted_prefix
from specpool.target_service.remote.codec import Q, unusable
from specpool.target_service.remote.wire import SequenceReply, read_entry
from specpool_client.v1 import speculation_pb2 as pb

if TYPE_CHECKING:
    from specpool.target_service.remote.connection import Connection
    from specpool.target_service.remote.drafter import RunningMean
    from specpool.target_service.remote.sessions import Session

log = logging.getLogger("specpool.target.speculation")


class OutcomeTables:
    """SSD push: the latest table the endpoint sent per sequence (written by the connection's reader)."""

    def __init__(self):
        self._tables: dict[str, pb.OutcomeTable] = {}
        self._changed = threading.Condition()

    def put(self, tables: Iterable[pb.OutcomeTable]) -> None:
        with self._changed:
            for table in tables:
                self._tables[table.request_id] = table
            self._changed.notify_all()

    def wait_for(self, seq_id: str, follows: list[int], timeout_s: float, broken: threading.Event):
        """The table for these outstanding drafts, waiting up to timeout_s for it to arrive."""
        end = time.monotonic() + timeout_s
        with self._changed:
            while True:
                table = self._tables.get(seq_id)
                if table is not None and list(table.follows) == follows:
                    return table
                left = end - time.monotonic()
                if left <= 0 or broken.is_set():
                    return None
                self._changed.wait(left)


@dataclass(frozen=True, slots=True)
class Resolved:
    """An SSD sequence's drafts for this round, found on the target without asking the endpoint."""

    # True: the endpoint's pushed drafts (it counts on them being verified); False: its table said it
    # would back off to n-gram drafts, so they were drafted here.
    table_hit: bool
    tokens: list[int]  # [n] draft ids
    q: Q  # sparse (ids [n, k], probs [n, k]), or None (a point mass)


class SsdPush:
    """Looks an SSD sequence's outcome up in its pushed table (push mode), and counts its hits either way."""

    def __init__(self, push: bool, vocab_size: int, hit_ratio: RunningMean):
        self.push = push  # take drafts from pushed outcome tables (else pull each round)
        self.vocab_size = vocab_size
        self.hit_ratio = hit_ratio  # the drafter's, read by the draft-length policy

    def resolve(self, conn: Connection, seq_id: str, seq: Session, n: int, timeout_s: float,
                draft_locally: Callable[[str, int], list[int]]) -> Resolved | None:
        """Counts the lookup; in push mode, the drafts when the pushed table answers this outcome (a hit)
        or says the endpoint would back off to n-gram drafts anyway (then drafted here by draft_locally,
        with no round trip). None: ask the endpoint. timeout_s: how long to wait for the table."""
        k = accepted_prefix(seq.drafts, seq.pending)
        if not seq.drafts or len(seq.pending) != k + 1:
            return None
        seq.cache_lookups += 1
        if not self.push or n <= 0:
            return None
        table = conn.table_for(seq_id, seq.drafts, timeout_s)
        if table is None:
            return None
        for entry in table.entries:
            if entry.accepted == k and entry.bonus == seq.pending[k]:
                pushed = read_entry(entry, n)
                problem = unusable(pushed.tokens, pushed.q, n, pushed.q_sent, self.vocab_size)
                if problem:
                    log.warning("endpoint's table for %s is unusable (%s); asking instead", seq_id, problem)
                    return None
                seq.cache_hits += 1
                self.hit_ratio.add(1.0)
                return Resolved(True, pushed.tokens, pushed.q)
        if table.fast_backup:
            self.hit_ratio.add(0.0)
            return Resolved(False, draft_locally(seq_id, n), None)
        return None

    def replied(self, seq: Session, reply: SequenceReply) -> None:
        """An SSD sequence's drafts came in a round's reply: a hit if they came from a fork."""
        if reply.tokens:  # a first round counts as a miss: close enough
            seq.cache_hits += reply.from_cache
            self.hit_ratio.add(float(reply.from_cache))
