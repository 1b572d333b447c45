"""What a target service tells the registry on every heartbeat: address, load and predicted speedups."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specpool.common.registry_schema import MAX_LIST_ITEMS
from specpool.engine.decoding import Decoder
from specpool.engine.method import METHODS, NO_ESTIMATE, Method, MethodRow
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts, peek_step_costs
from specpool.engine.policy.draft_length import SpeculationPolicy
from specpool.engine.runtime.model import Llama
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.scheduler import Scheduler

log = logging.getLogger(__name__)


def predicted_speedup(policy: SpeculationPolicy | None, batch_size: int, acceptance: AcceptanceEstimate) -> float:
    """The policy's own estimate (SpeculationPolicy.speedup) of its best speculative rate over plain
    decoding at this batch size, with the acceptance and fill measured and the slowdown real rounds
    showed. Below 1, speculating would slow the batch down; NO_ESTIMATE when there is no policy to ask."""
    if policy is None:
        return NO_ESTIMATE
    return policy.speedup(batch_size, acceptance.expected_tokens, acceptance.fill)[1]


@dataclass(frozen=True, slots=True)
class Layout:
    """SSD's hardware: the target's own CPU threads, and the cores of its whole layout (the target plus
    the drafter it shares hardware with) that plain decoding could use instead of speculating."""

    threads: int
    cores: int
    costs: StepCosts | None = None  # this model's step costs at `cores` threads, when a table is cached
    on_cpu: bool = True

    @classmethod
    def of(cls, model: Llama, model_id: str, threads: int, cores: int | None,
           cache_dir: Path | None = None, **kwargs) -> Layout:
        """The layout of a target running `threads` threads among `cores` (None: its own threads), with
        the step costs cached_step_costs keeps for `cores` threads (and its `kwargs`), if any (none is
        measured here: measuring would take the drafter's cores from it)."""
        cores = cores or threads
        on_cpu = model.device.type == "cpu"
        costs = peek_step_costs(model, model_id, cores, cache_dir, **kwargs) if on_cpu and cores > threads else None
        return cls(threads, cores, costs, on_cpu)


NO_LAYOUT = Layout(threads=1, cores=1)  # the target's own hardware: no discount


def ar_on_layout_ratio(layout: Layout, own_costs: StepCosts | None, batch_size: int) -> float:
    """Plain step time on all the layout's cores over that on the target's own threads: SSD's speedup
    over plain decoding on the target's threads, times this, is its speedup over the plain decoding the
    same hardware would run instead. From the cached table at the layout's core count when there is
    one (at most 1: plain decoding could keep to the target's threads); else perfect scaling
    (threads / cores), the most plain decoding could gain, so that routers never plan SSD at a loss.
    1 off the CPU: a drafter's GPU does not speed the target's plain decoding."""
    if not layout.on_cpu or layout.cores <= layout.threads:
        return 1.0
    if layout.costs is not None and own_costs is not None:
        return min(1.0, layout.costs(batch_size, 0) / own_costs(batch_size, 0))
    return layout.threads / layout.cores


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
    drafter: RemoteDrafter | None
    free_policy: SpeculationPolicy | None  # n-gram drafting (costs the target nothing measurable)
    # The draft-model policy, which exists once the endpoint has told its draft costs.
    draft_policy_fn: Callable[[], SpeculationPolicy | None] = lambda: None
    # SSD's policy, wire time included (TargetDraftLength.ssd_policy), and the layout it runs in.
    ssd_policy_fn: Callable[[], SpeculationPolicy | None] = lambda: None
    layout: Layout = NO_LAYOUT
    format: str = ""  # the model's format and its start-up check (Llama.format_label)

    def fields(self) -> dict:
        running, queued = self.scheduler.load()
        batch = running + 1  # what admitting one more request would run at
        draft_policy, free_policy = self.draft_policy_fn(), self.free_policy
        has_endpoint = bool(self.drafter and self.drafter.address)
        if has_endpoint:  # a planned method drafts on the endpoint: each round pays its measured wire time
            wire = self.drafter.wire_s.value
            draft_policy, free_policy = (p and dataclasses.replace(p, round_s=wire) for p in (draft_policy, free_policy))
        policies = {"model": draft_policy, "misses": self.ssd_policy_fn(), "free": free_policy}
        planned = [row for row in METHODS if row.speedup_field is not None]
        own_costs = self.free_policy.target_costs if self.free_policy is not None else None

        def speedup(row: MethodRow, batch_size: int) -> float:
            # By the acceptance the method's own sequences measured (Decoder.acceptance_of).
            value = predicted_speedup(policies[row.charges], batch_size, self.decoder.acceptance_of(row.method))
            if row.method is Method.SSD:  # it must beat plain decoding on all its layout's cores, not only its own
                value *= ar_on_layout_ratio(self.layout, own_costs, batch_size)
            return round(value, 4)

        speedups = {row.method: speedup(row, batch) for row in planned}
        # At every batch size a request may join: a router plans a burst of requests by the batch each one joins.
        batch_sizes = range(1, min(max(self.max_batch, 1), MAX_LIST_ITEMS) + 1)
        by_batch = {f"{row.speedup_field}_by_batch": [speedup(row, b) for b in batch_sizes] for row in planned}
        for method, value in speedups.items():
            self.metrics.predicted(method.value, value)
        endpoint_up = has_endpoint and self.drafter.healthy
        methods = [row.method for row in planned if row.local or endpoint_up]
        return {
            "address": self.address,
            "model": self.model,
            "tenant": self.tenant,
            "max_batch": self.max_batch,
            "running": running,
            "queued": queued,
            "spec_endpoint": self.drafter.address if has_endpoint else "",
            "mean_accept_len": round(self._mean_accept_len(), 4),
            **{row.speedup_field: speedups[row.method] for row in planned},
            **by_batch,
            "methods": [m.value for m in methods],
            # Priced from the acceptance prior alone, until a round offers its drafter positions (router/decisions.py).
            "unmeasured": [row.method.value for row in planned if not self.decoder.acceptance_of(row.method).offers],
            "format": self.format,
        }

    def _mean_accept_len(self) -> float:
        labels = {"model": self.model, "tenant": self.tenant}
        registry = self.metrics.registry
        count = registry.get_sample_value("specpool_target_accept_length_count", labels) or 0.0
        total = registry.get_sample_value("specpool_target_accept_length_sum", labels) or 0.0
        return total / count if count else 0.0


def refresh_without_registry(fields_fn: Callable[[], dict], interval_s: float = 1.0) -> threading.Event:
    """A target with no registry still reads its heartbeat's fields every interval_s, so the predicted speedups on
    its /metrics stay live (Grafana's and `specpool bench`'s view of them). Set the returned event to stop."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            try:
                fields_fn()
            except Exception:
                log.exception("reading the heartbeat's fields failed; predicted speedups not refreshed")

    threading.Thread(target=run, name="predicted-speedups", daemon=True).start()
    return stop
