"""When the batcher expects a stream's next round (spec_endpoint.streams.StreamClock): a step waits for a
round due within half its own stream's period, so that tenants share one draft forward."""

from __future__ import annotations

import pytest

from specpool.spec_endpoint.streams import StreamClock

# Two targets' round arrivals (s), from an endpoint's log, each target with 8 requests of 24 tokens: the
# first gaps hold prefills and a full batch's verify; then the rounds speed up as sequences finish.
ARRIVALS = {
    "alpha": [0.0, 0.341, 0.614, 0.677, 0.750, 0.815, 0.869, 0.927, 0.972, 1.017, 1.066, 1.105, 1.127, 1.148],
    "beta": [0.0, 0.316, 0.379, 0.436, 0.493, 0.560, 0.621, 0.682, 0.747, 0.791, 0.839, 0.890, 0.923, 0.952,
             0.981, 0.998, 1.010],
}


@pytest.mark.parametrize("target", sorted(ARRIVALS))
def test_a_stream_clock_expects_the_next_round_of_a_stream_that_speeds_up(target):
    """Found in CI (no shared batch in 29): a moving average of every gap, seeded by the first, slow
    ones, expected each round up to 4 gaps late, so the other stream's round, due sooner, never waited
    for it. From the third gap on, each round is now expected less than a gap off, a quarter gap on
    average."""
    arrivals = [100 + t for t in ARRIVALS[target]]  # monotonic seconds
    clock = StreamClock()
    errors, gaps = [], []
    for i, (now, following) in enumerate(zip(arrivals, arrivals[1:])):
        clock.arrived(now)
        if i >= 3:
            errors.append(abs(clock.next_at - following))
            gaps.append(following - now)
    assert all(e < g for e, g in zip(errors, gaps)), [(round(e, 3), round(g, 3)) for e, g in zip(errors, gaps)]
    assert sum(errors) <= sum(gaps) / 4


def test_a_stream_clock_is_busy_until_two_periods_pass_without_a_round():
    clock = StreamClock()
    assert not clock.busy(10.0)
    clock.arrived(10.0)
    assert not clock.busy(10.01)  # one arrival: no period yet
    clock.arrived(10.1)
    assert clock.busy(10.25) and not clock.busy(10.31)
