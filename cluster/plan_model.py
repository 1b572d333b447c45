"""The capacity model behind `specpool plan`: how many speculation endpoints (and target replicas)
a demand mix needs.

The model, from measured statistics (a `specpool bench` JSON; a live /capacity JSON, which gives
the endpoints' session capacity and the speedups the targets' own policies predict; or numbers
written into the demand file):

- A target replica of model m runs at batch b_m. Decoding alone it produces tps_ar_m tokens/s
  (the batch's total; bench mode `ar` at batch b). A sequence that holds a draft slot on an
  endpoint drafts with the draft model and its share of the replica runs s_m times faster (the
  fastest draft-model mode measured at batch b, sd/ssd, `speedup_vs_ar`; or what the targets'
  policies predict). One without a slot gets what the router gives it then: n-gram drafting,
  which needs no slot, when that beats AR (speedup s0_m, measured `ngram`), else AR (s0_m = 1).
  `--fallback-mode ar` makes the simplest model: a slot buys s_m, no slot is AR.
- An endpoint serves up to C concurrent sessions (its capacity: /capacity's maxSessions, the
  demand file's `endpoint_sessions`, or by default the batch size the bench measured, since the
  bench's drafter served that many sequences at that speedup).
- With n endpoints and R_m replicas, full replicas hold sum_m R_m b_m sequences; the router shares
  draft slots by weight, so every sequence gets one with the same probability
  f = min(1, n C / sum_m R_m b_m). Replica throughput mixes linearly:
  tps_m = tps_ar_m (s0_m + f (s_m - s0_m)); the mean speedup is s0 + f (s - s0), throughput-weighted.
- Demand of model m: requests_per_s × (mean_output_tokens / speedup + prefill_token_cost ×
  prompt_tokens) replica-seconds of AR tokens each second (prefill is not sped up by drafting; a
  prompt token costs `prefill_token_cost` of a decoded token, an assumption to set from your
  own measurement). R_m is the smallest count with utilization × R_m × tps_m >= that demand.
- Cost = sum_m R_m × target_cost_m + n × endpoint_cost (relative units, default 1 each).

For n = 0, 1, ... (until every sequence has a slot, then one more, or --max-endpoints) it finds
the smallest replica counts meeting the demand, and recommends the n with the smallest total
cost (ties: the higher mean speedup). R starts at the AR answer (feasible for any n) and drops
one replica at a time while the demand is still met; fewer replicas only raise f, and for one
model the feasible counts form an interval, so this is the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_ENDPOINTS = 64


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Measured speed of one target model on one replica at its operating batch size."""

    batch_size: int
    tokens_per_s_ar: float  # the replica's total at that batch, decoding alone
    speedup: float  # with a draft slot (the pooled mode)
    mode: str = "measured"  # which measured mode gave `speedup`
    fallback_speedup: float = 1.0  # without a slot (1: AR)
    fallback_mode: str = "ar"


@dataclass(frozen=True, slots=True)
class ModelDemand:
    name: str  # the target model, as targets register it
    requests_per_s: float  # arrivals
    mean_output_tokens: float  # decoded per request
    prompt_tokens: float = 0.0  # prefilled per request (mean)
    target_cost: float = 1.0  # of one replica, relative to an endpoint's endpoint_cost
    stats: ModelStats | None = None  # None: looked up in the statistics given to the planner


@dataclass(frozen=True, slots=True)
class Demand:
    models: tuple[ModelDemand, ...]
    endpoint_cost: float = 1.0
    endpoint_sessions: int | None = None  # C; None: from the statistics
    utilization: float = 0.8  # of a replica's measured throughput, kept as headroom for bursts
    prefill_token_cost: float = 0.0


@dataclass(frozen=True, slots=True)
class PlanRow:
    endpoints: int
    slot_fraction: float  # f: share of sequences that hold a draft slot
    mean_speedup: float  # throughput-weighted, over all models
    replicas: dict[str, int]
    cost: float

    @property
    def total_replicas(self) -> int:
        return sum(self.replicas.values())


@dataclass(frozen=True, slots=True)
class Plan:
    rows: tuple[PlanRow, ...]
    endpoint_sessions: int
    demand: Demand
    notes: tuple[str, ...] = field(default=())

    @property
    def best(self) -> PlanRow:
        return min(self.rows, key=lambda r: (round(r.cost, 9), -r.mean_speedup, r.endpoints))


def _needed_ar_seconds(m: ModelDemand, speedup: float, prefill_token_cost: float) -> float:
    """AR-token-seconds of one replica per second of demand: what utilization × R × tps_ar must cover."""
    return m.requests_per_s * (m.mean_output_tokens / speedup + prefill_token_cost * m.prompt_tokens)


def _fraction(endpoints: int, sessions: int, replicas: dict[str, int], demand: Demand) -> float:
    sequences = sum(replicas[m.name] * m.stats.batch_size for m in demand.models)
    return 1.0 if sequences == 0 else min(1.0, endpoints * sessions / sequences)


def _speedup(m: ModelDemand, f: float) -> float:
    s0 = m.stats.fallback_speedup
    return s0 + f * max(0.0, m.stats.speedup - s0)  # the router does not speculate where it loses


def _meets(replicas: dict[str, int], endpoints: int, sessions: int, demand: Demand) -> bool:
    f = _fraction(endpoints, sessions, replicas, demand)
    return all(
        demand.utilization * replicas[m.name] * m.stats.tokens_per_s_ar
        >= _needed_ar_seconds(m, _speedup(m, f), demand.prefill_token_cost) - 1e-9
        for m in demand.models
    )


def plan_row(demand: Demand, endpoints: int, sessions: int) -> PlanRow:
    """Smallest replica counts meeting the demand with `endpoints` endpoints of `sessions` slots each."""
    replicas = {
        m.name: max(1, math.ceil(_needed_ar_seconds(m, m.stats.fallback_speedup, demand.prefill_token_cost)
                                 / (demand.utilization * m.stats.tokens_per_s_ar) - 1e-9))
        for m in demand.models
    }
    lowered = True
    while lowered:
        lowered = False
        for m in demand.models:
            if replicas[m.name] > 1:
                fewer = {**replicas, m.name: replicas[m.name] - 1}
                if _meets(fewer, endpoints, sessions, demand):
                    replicas, lowered = fewer, True
    f = _fraction(endpoints, sessions, replicas, demand)
    tokens = {m.name: replicas[m.name] * m.stats.tokens_per_s_ar for m in demand.models}
    mean_speedup = sum(tokens[m.name] * _speedup(m, f) for m in demand.models) / sum(tokens.values())
    cost = sum(replicas[m.name] * m.target_cost for m in demand.models) + endpoints * demand.endpoint_cost
    return PlanRow(endpoints, f, mean_speedup, replicas, cost)


def make_plan(demand: Demand, max_endpoints: int | None = None) -> Plan:
    missing = [m.name for m in demand.models if m.stats is None]
    if missing:
        raise ValueError(f"no measured statistics for {', '.join(missing)}: give --stats (a specpool bench JSON) "
                         "or tokens_per_s_ar and speedup in the demand file")
    sessions = demand.endpoint_sessions or max(m.stats.batch_size for m in demand.models)
    if sessions < 1:
        raise ValueError(f"endpoint_sessions must be >= 1, got {sessions}")
    rows = []
    limit = MAX_ENDPOINTS if max_endpoints is None else max_endpoints
    saturated_at = None
    for n in range(limit + 1):
        rows.append(plan_row(demand, n, sessions))
        if saturated_at is None and rows[-1].slot_fraction >= 1.0:
            saturated_at = n
        if max_endpoints is None and saturated_at is not None and n >= max(saturated_at + 1, 1):
            break
    notes = []
    if all(m.stats.speedup <= m.stats.fallback_speedup for m in demand.models):
        notes.append("a draft slot is not faster than decoding without one (the fallback) at these batch sizes: "
                     "endpoints add only cost")
    return Plan(tuple(rows), sessions, demand, tuple(notes))
