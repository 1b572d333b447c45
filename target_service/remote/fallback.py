"""Failing open: when to stop waiting on the endpoint (DeadlineBreaker), and the reasons a sequence's
round is drafted by the target's own n-gram index instead (each a metric label)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from enum import StrEnum

log = logging.getLogger("specpool.target.speculation")


class Fallback(StrEnum):
    """Why a sequence-round was drafted locally (the `reason` label of spec_fallback_rounds)."""

    NO_ENDPOINT = "no_endpoint"  # none configured
    ENDPOINT_UNAVAILABLE = "endpoint_unavailable"  # configured, not attached
    ENDPOINT_FAILED = "endpoint_failed"  # the connection broke during the round
    BREAKER_OPEN = "breaker_open"  # its rounds keep coming late: only probes go out
    DEADLINE = "deadline"  # this round's reply came late
    SESSION_UNAVAILABLE = "session_unavailable"  # not opened (yet), or its dense q has no channel
    SESSION_LOST = "session_lost"  # the endpoint could not draft it (it re-opens next round)
    BAD_REPLY = "bad_reply"  # drafts that cannot be verified

    @property
    def detaches(self) -> bool:
        """Whether the endpoint is gone with it (the attached gauge drops)."""
        return self in (Fallback.ENDPOINT_FAILED, Fallback.ENDPOINT_UNAVAILABLE)




class DeadlineBreaker:
    """Stops a target waiting on an endpoint whose rounds keep coming late (hung, overloaded, a slow link).

    Closed, a round waits up to `deadline()`: twice the slowest of the last 64 round trips, within
    [MIN_DEADLINE_S, the configured deadline], so a late round costs a few healthy round trips, not
    the configured worst case. After `trip_after` late rounds in a row it opens: nothing waits on
    the endpoint (sequences draft locally) and one probe round at a time goes out, every `probe_s`.
    Every reply is timed, however late; the first back within the deadline closes it.
    Called from the step thread, and from the connection's reader thread (`replied`).
    """

    MIN_DEADLINE_S = 0.05

    def __init__(self, deadline_s: float, trip_after: int = 3, probe_s: float = 0.25, clock=time.monotonic):
        self.max_deadline_s = deadline_s
        self.trip_after = trip_after
        self.probe_s = probe_s
        self.clock = clock
        self.open = False
        self._round_trips: deque[float] = deque(maxlen=64)
        self._late_in_a_row = 0
        self._probe_sent_at: float | None = None
        self._lock = threading.Lock()

    def deadline(self) -> float:
        with self._lock:
            return self._deadline()

    def _deadline(self) -> float:
        if len(self._round_trips) < 8:
            return self.max_deadline_s
        # Twice the slowest of the recent replies: a healthy endpoint's occasional slow round (its batch
        # window, a busy core) is never cut short; a 90th percentile was, and drafted rounds fell back.
        return min(self.max_deadline_s, max(self.MIN_DEADLINE_S, 2 * max(self._round_trips)))

    def on_time(self) -> None:
        with self._lock:
            self._late_in_a_row = 0

    def late(self) -> None:
        with self._lock:
            self._late_in_a_row += 1
            if self.open or self._late_in_a_row < self.trip_after:
                return
            self.open, self._probe_sent_at = True, None
            deadline = self._deadline()
        log.warning("speculation endpoint late %d rounds in a row; drafting locally until a round comes back "
                    "within %.0f ms", self.trip_after, deadline * 1e3)

    def probe_due(self) -> bool:
        """While open: whether to send a probe round now (one at a time; a lost one is replaced)."""
        with self._lock:
            now, sent = self.clock(), self._probe_sent_at
            if sent is not None and now - sent < max(self.probe_s, self.max_deadline_s):
                return False
            self._probe_sent_at = now
            return True

    def replied(self, round_trip_s: float) -> None:
        """A round's reply arrived, this long after it was sent."""
        with self._lock:
            self._round_trips.append(round_trip_s)
            if not self.open:
                return
            if round_trip_s > self._deadline():
                self._probe_sent_at = None  # answered, late: the next probe may go at once
                return
            self.open, self._late_in_a_row = False, 0
        log.info("speculation endpoint answered in %.0f ms; drafting on it again", round_trip_s * 1e3)
