"""Prometheus metrics of a target service: base units, labelled by model and tenant, never by request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specpool.common import outcomes

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
        self.fallback_rounds = Counter("specpool_target_spec_fallback_rounds",
                                       "Sequence-rounds drafted locally instead of by the endpoint, by reason",
                                       [*names, "reason"], registry=r)
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

    def fallback(self, reason: str, count: int) -> None:
        self.fallback_rounds.labels(**self._labels, reason=reason).inc(count)

    def count(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def observe_request(self, request: Request) -> None:
        failed = any(r.finish_reason == "error" for r in request.results)
        if request.cancelled:
            self.count(outcomes.EXPIRED if request.expired else outcomes.CANCELLED)
        else:
            self.count(outcomes.ERROR if failed else outcomes.OK)
        tokens = sum(len(r.token_ids) for r in request.results)
        self.generated_tokens.inc(tokens)
        for r in request.results:
            if r.target_steps:
                self.accept_length.observe(r.mean_accept_len)
        if request.first_token_at is not None and tokens > request.n:
            self.tpot.observe((request.finished_at - request.first_token_at) / (tokens / request.n - 1))
