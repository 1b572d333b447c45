"""Prometheus metrics of a target service: base units, labelled by model and tenant, never by request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specpool.common import outcomes
from specpool.engine.method import MAX_DRAFT_TOKENS
from specpool.target_service.remote.fallback import Fallback

if TYPE_CHECKING:
    from specpool.target_service.scheduler import Request

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class TargetMetrics:
    def __init__(self, model: str, tenant: str):
        self.registry = CollectorRegistry()
        labels = {"model": model, "tenant": tenant}
        names = list(labels)

        def labelled(metric):
            return metric.labels(**labels)

        r = self.registry
        # Every request once, however it ended (specpool/common/outcomes.py), refused ones included.
        self.requests = Counter("specpool_target_requests", "Requests by outcome: ok, cancelled, invalid, not_found, "
                                "rejected, unavailable, expired, error", [*names, "outcome"], registry=r)
        self._labels = labels
        self.generated_tokens = labelled(Counter("specpool_target_generated_tokens", "Tokens emitted",
                                                 names, registry=r))
        self.ttft = labelled(Histogram("specpool_target_time_to_first_token_seconds", "Submit to first token",
                                       names, buckets=LATENCY_BUCKETS, registry=r))
        self.tpot = labelled(Histogram("specpool_target_time_per_output_token_seconds",
                                       "Per request: (finish - first token) / (tokens - 1)", names,
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
                                       registry=r))
        self.accept_length = labelled(Histogram("specpool_target_accept_length",
                                                "Per request: tokens per target step, bonus included", names,
                                                buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8), registry=r))
        self.step_seconds = labelled(Histogram("specpool_target_step_seconds", "One prefill or verify step",
                                               names, buckets=LATENCY_BUCKETS, registry=r))
        self.verify_seconds = labelled(Histogram(
            "specpool_target_verify_seconds", "One round's verify forward and acceptance, without the wait for drafts",
            names, buckets=LATENCY_BUCKETS, registry=r))
        self.round_seconds = labelled(Histogram(
            "specpool_target_round_seconds", "One decode step whole: the wait for drafts, the verify forward, "
            "acceptance and the policy's choices", names, buckets=LATENCY_BUCKETS, registry=r))
        self.fallback_rounds = Counter("specpool_target_spec_fallback_rounds",
                                       "Sequence-rounds drafted locally instead of by the endpoint, by reason",
                                       [*names, "reason"], registry=r)
        for reason in Fallback:  # every reason from the start: a rate of 0, not an absent series
            self.fallback_rounds.labels(**labels, reason=reason.value)
        self.spec_round_seconds = labelled(Histogram(
            "specpool_target_spec_round_seconds", "Waiting for the endpoint's drafts, per round", names,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64), registry=r))
        self.spec_wire_seconds = labelled(Histogram(
            "specpool_target_spec_wire_seconds", "Round wait minus the endpoint's drafting time: the wire's cost",
            names, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16), registry=r))
        self.endpoint_attached = labelled(Gauge("specpool_target_spec_endpoint_attached",
                                                "1 while attached to a speculation endpoint", names, registry=r))
        self.spec_breaker_open = labelled(Gauge(
            "specpool_target_spec_breaker_open",
            "1 while the endpoint's rounds keep missing their deadline and this target drafts locally", names,
            registry=r))
        self.spec_deadline_seconds = labelled(Gauge(
            "specpool_target_spec_deadline_seconds", "How long a round now waits for the endpoint's drafts", names,
            registry=r))
        self.running = labelled(Gauge("specpool_target_running_sequences", "Sequences in the batch", names,
                                      registry=r))
        self.queued = labelled(Gauge("specpool_target_queued_requests", "Requests waiting for a slot", names,
                                     registry=r))
        # Capacity, and what speculation buys (the dashboard's capacity-planning panels).
        self.max_batch = labelled(Gauge("specpool_target_max_batch", "Sequences the batch holds (--max-batch)",
                                        names, registry=r))
        self.queue_wait = labelled(Histogram(
            "specpool_target_queue_wait_seconds", "Submit to admission into the batch (a request cancelled "
            "while queued: submit to cancel)", names, buckets=LATENCY_BUCKETS, registry=r))
        self.prompt_tokens = labelled(Counter("specpool_target_prompt_tokens", "Prompt tokens of admitted "
                                              "requests", names, registry=r))
        self.predicted_speedup = Gauge(
            "specpool_target_predicted_speedup", "The speculation policy's predicted speedup over plain decoding "
            "at the next batch size, by drafter (what each heartbeat tells the routers; ssd's over plain decoding on "
            "all its layout's cores)", [*names, "method"],
            registry=r)
        # By the method the request asked for (SpeculationPlan.label: a few values) and the position of a
        # draft in its round (1: the first after the last emitted token; a tree's nodes at depth + 1).
        self.drafts_offered = Counter("specpool_target_drafts_offered", "Draft tokens verified, by position",
                                      [*names, "method", "position"], registry=r)
        self.drafts_accepted = Counter("specpool_target_drafts_accepted", "Draft tokens accepted, by position",
                                       [*names, "method", "position"], registry=r)
        # Per completion, from its first token to its end (wall time): tokens / seconds is a sequence's decode
        # rate, the inverse of TPOT, and speculating methods over "none" the speedup requests see.
        self.decode_tokens = Counter("specpool_target_decode_tokens", "Tokens completions emitted after their "
                                     "first, by method", [*names, "method"], registry=r)
        self.decode_seconds = Counter("specpool_target_decode_seconds", "Completions' time from their first "
                                      "token to their end, by method", [*names, "method"], registry=r)
        self.plan_drops = Counter("specpool_target_plan_drops", "Completions' plans that fell to the next one "
                                  "down, measured slower than plain decoding, by the method planned",
                                  [*names, "method"], registry=r)

    def fallback(self, reason: str, count: int) -> None:
        self.fallback_rounds.labels(**self._labels, reason=reason).inc(count)

    def count(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def predicted(self, method: str, speedup: float) -> None:
        self.predicted_speedup.labels(**self._labels, method=method).set(speedup)

    def admitted(self, request: Request, now: float) -> None:
        self.queue_wait.observe(now - request.submitted_at)
        self.prompt_tokens.inc(len(request.prompt_ids))

    def observe_request(self, request: Request) -> None:
        failed = any(r.finish_reason == "error" for r in request.results)
        if request.cancelled:
            self.count(outcomes.EXPIRED if request.expired else outcomes.CANCELLED)
        else:
            self.count(outcomes.ERROR if failed else outcomes.OK)
        tokens = sum(len(r.token_ids) for r in request.results)
        self.generated_tokens.inc(tokens)
        method = request.speculation.label
        for r in request.results:
            if r.target_steps:
                self.accept_length.observe(r.mean_accept_len)
            if r.plan_drops:
                self.plan_drops.labels(**self._labels, method=method).inc(r.plan_drops)
            self._count_positions(method, r.offered_at, r.accepted_at)
        if request.first_token_at is not None and tokens > request.n:
            decode_s = request.finished_at - request.first_token_at
            self.tpot.observe(decode_s / (tokens / request.n - 1))
            self.decode_tokens.labels(**self._labels, method=method).inc(tokens - request.n)
            self.decode_seconds.labels(**self._labels, method=method).inc(decode_s * request.n)

    def _count_positions(self, method: str, offered: list[int], accepted: list[int]) -> None:
        for k, (n_offered, n_accepted) in enumerate(zip(offered, accepted)):
            # A round holds at most MAX_DRAFT_TOKENS drafts; deeper (none today) count at the last position.
            position = str(min(k + 1, MAX_DRAFT_TOKENS))
            if n_offered:
                self.drafts_offered.labels(**self._labels, method=method, position=position).inc(n_offered)
                self.drafts_accepted.labels(**self._labels, method=method, position=position).inc(n_accepted)
