"""What a target service tells the registry on every heartbeat: address, load and predicted speedups."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from specpool.common.speculation import Method
from specpool.engine.decoding import Decoder
from specpool.engine.speculation_policy import AcceptanceEstimate, SpeculationPolicy
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.scheduler import Scheduler


def predicted_speedup(policy: SpeculationPolicy | None, batch_size: int, acceptance: AcceptanceEstimate) -> float:
    """The policy's own estimate (SpeculationPolicy.speedup) of its best speculative rate over plain
    decoding at this batch size, with the acceptance and fill measured and the slowdown real rounds
    showed. Below 1, speculating would slow the batch down; 1.0 when there is no policy to ask."""
    if policy is None:
        return 1.0
    return policy.speedup(batch_size, acceptance.expected_tokens, acceptance.fill)[1]


@dataclass
class HeartbeatFields:
    """Reads the live process (scheduler load, measured acceptance, its policies) for `Heartbeat`."""

    address: str
    model: str
    tenant: str
    max_batch: int
    scheduler: Scheduler
    decoder: Decoder
    metrics: TargetMetrics
    client: RemoteDrafter | None
    free_policy: SpeculationPolicy | None  # n-gram drafting (costs the target nothing measurable)
    # The draft-model policy, which exists once the endpoint has told its draft costs.
    draft_policy_fn: Callable[[], SpeculationPolicy | None] = lambda: None

    def fields(self) -> dict:
        running, queued = self.scheduler.load()
        acceptance = self.decoder.acceptance
        batch = running + 1  # what admitting one more request would run at
        draft_policy, free_policy = self.draft_policy_fn(), self.free_policy
        has_endpoint = bool(self.client and self.client.address)
        if has_endpoint:  # a planned method drafts on the endpoint: each round pays its measured wire time
            wire = self.client.wire_s.value
            draft_policy, free_policy = (p and dataclasses.replace(p, round_s=wire) for p in (draft_policy, free_policy))
        methods = [Method.NGRAM]
        if has_endpoint and self.client.healthy:
            methods[:0] = [Method.SSD, Method.DRAFT_MODEL]
        speedups = {Method.DRAFT_MODEL: round(predicted_speedup(draft_policy, batch, acceptance), 4),
                    Method.NGRAM: round(predicted_speedup(free_policy, batch, acceptance), 4)}
        for method, speedup in speedups.items():
            self.metrics.predicted(method.value, speedup)
        return {
            "address": self.address,
            "model": self.model,
            "tenant": self.tenant,
            "max_batch": self.max_batch,
            "running": running,
            "queued": queued,
            "spec_endpoint": self.client.address if has_endpoint else "",
            "mean_accept_len": round(self._mean_accept_len(), 4),
            "predicted_speedup_draft": speedups[Method.DRAFT_MODEL],
            "predicted_speedup_ngram": speedups[Method.NGRAM],
            "methods": [m.value for m in methods],
        }

    def _mean_accept_len(self) -> float:
        labels = {"model": self.model, "tenant": self.tenant}
        registry = self.metrics.registry
        count = registry.get_sample_value("specpool_target_accept_length_count", labels) or 0.0
        total = registry.get_sample_value("specpool_target_accept_length_sum", labels) or 0.0
        return total / count if count else 0.0
