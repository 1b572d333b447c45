"""The Rounds streams' side of the engine loop: where replies go, what a step takes from the shared
queue, and when each stream's next round is due."""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import dataclass

from specpool.common.errors import FieldError
from specpool.spec_endpoint.messages import Round, RoundResult
from specpool.spec_endpoint.sessions import SessionKey


class RoundStream:
    """One Rounds call: its replies in order. None ends the stream; a FieldError aborts it."""

    def __init__(self) -> None:
        self.outbound: queue.Queue[RoundResult | FieldError | None] = queue.Queue()

    def fail(self, error: FieldError) -> None:
        self.outbound.put(error)

    def cancel(self) -> None:
        """The client went away: wake the reply generator. Its sessions stay until their lease ends."""
        self.outbound.put(None)


@dataclass(frozen=True, slots=True)
class Queued:
    stream: RoundStream
    round: Round | None  # None: the stream's input ended (answer it after its earlier rounds)
    arrived: float = 0.0  # monotonic seconds


def split_conflicts(items: list[Queued]) -> tuple[list[Queued], list[Queued]]:
    """-> (this step's items, the rest). A round that names a session an earlier round of this
    step already names waits for the next step, and so does everything after it on its stream."""
    now: list[Queued] = []
    later: list[Queued] = []
    seen: set[SessionKey] = set()
    blocked: set[int] = set()
    for item in items:
        if id(item.stream) in blocked:
            later.append(item)
            continue
        if item.round is not None:
            keys = {SessionKey(item.round.tenant, s.request_id) for s in item.round.sequences}
            if keys & seen:
                blocked.add(id(item.stream))
                later.append(item)
                continue
            seen |= keys
        now.append(item)
    return now, later


class StreamClock:
    """When a stream's rounds arrive: the last one and its period, the shorter of its last two gaps.

    A stream's rounds speed up as its batch empties (its first gaps hold prefills): an average of its
    gaps expected the next round whole rounds late. One slow gap (a prefill joining, a busy core) does
    not move the expected time either."""

    GAPS = 2

    def __init__(self) -> None:
        self.last = 0.0
        self._gaps: deque[float] = deque(maxlen=self.GAPS)

    def arrived(self, now: float) -> None:
        if self.last:
            self._gaps.append(now - self.last)
        self.last = now

    @property
    def period(self) -> float:
        return min(self._gaps, default=0.0)

    @property
    def next_at(self) -> float:
        return self.last + self.period

    def busy(self, now: float) -> bool:
        return self.period > 0 and now - self.last < 2 * self.period
