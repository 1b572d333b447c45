"""DeadlineBreaker: how long a round waits for the endpoint, when the target stops waiting, and when it
starts again (the process-level behaviour, a SIGSTOPped endpoint, is in tests/cluster/test_fault_isolation.py)."""

from specpool.target_service.remote.fallback import DeadlineBreaker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_follows_recent_round_trips_within_its_bounds():
    breaker = DeadlineBreaker(deadline_s=0.5)
    assert breaker.deadline() == 0.5  # too few round trips measured yet
    for _ in range(20):
        breaker.replied(0.030)
    assert abs(breaker.deadline() - 0.060) < 1e-9  # twice the slowest
    for _ in range(40):
        breaker.replied(0.001)
    breaker.replied(0.200)  # one slow round (a batch window) among fast ones is not cut short next time
    assert abs(breaker.deadline() - 0.400) < 1e-9
    for _ in range(64):
        breaker.replied(0.001)
    assert breaker.deadline() == DeadlineBreaker.MIN_DEADLINE_S
    for _ in range(64):
        breaker.replied(2.0)
    assert breaker.deadline() == 0.5


def test_it_opens_after_late_rounds_in_a_row_probes_one_at_a_time_and_closes_on_a_timely_reply():
    clock = Clock()
    breaker = DeadlineBreaker(deadline_s=0.5, trip_after=3, probe_s=0.25, clock=clock)
    breaker.late()
    breaker.late()
    breaker.on_time()  # an on-time round resets the count
    breaker.late()
    breaker.late()
    assert not breaker.open
    breaker.late()
    assert breaker.open
    assert breaker.probe_due()
    assert not breaker.probe_due()  # one probe at a time
    clock.now += 0.3
    assert not breaker.probe_due()  # unanswered: replaced only after the deadline
    clock.now += 0.3
    assert breaker.probe_due()
    breaker.replied(0.8)  # answered, but late: still open, and the next probe may go at once
    assert breaker.open and breaker.probe_due()
    breaker.replied(0.02)
    assert not breaker.open
    breaker.late()
    breaker.late()
    assert not breaker.open  # the count started again
