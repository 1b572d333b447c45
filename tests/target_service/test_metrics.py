"""The target's capacity-planning metrics: acceptance by draft position adds up to the drafted and
accepted totals (chains and trees), the decode rate by method, prompt tokens, queue wait, and the
series that exist before anything happened (a rate of 0, not nothing)."""

from __future__ import annotations

import time

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.method import MAX_DRAFT_TOKENS, Method
from specpool.engine.plan import SpeculationPlan, TreeShape
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams, make_generator
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.remote.fallback import Fallback
from specpool.target_service.scheduler import Request

LABELS = {"model": "m", "tenant": "alpha"}


def sample(metrics: TargetMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


def by_position(metrics: TargetMetrics, name: str, method: str) -> dict[int, float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and s.labels["method"] == method:
                out[int(s.labels["position"])] = s.value
    return out


def request(results, method: Method = Method.DRAFT_MODEL, n: int = 1, prompt=(3, 4, 5)) -> Request:
    req = Request("r", list(prompt), SamplingParams(), 16, None, SpeculationPlan(method, remote=True), n=n)
    req.results = list(results)
    return req


@pytest.mark.parametrize("tree", [None, TreeShape(branch=3, beam=2, max_depth=4)], ids=["chains", "trees"])
def test_acceptance_by_position_adds_up_to_the_drafted_and_accepted_totals(tiny_model, tree):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
    params = SamplingParams() if tree else SamplingParams(temperature=1.0, seed=1)
    results = generate(tiny_model, prompts, params, 24, ModelDrafter(draft, 4, 64, tree=tree), 5, stop_ids=[],
                       generator=make_generator(1))
    for r in results:
        assert sum(r.offered_at) == r.drafted_tokens > 0
        assert sum(r.accepted_at) == r.accepted_tokens
        assert all(a <= o for a, o in zip(r.accepted_at, r.offered_at))
        # A round accepts position k+1 only after position k.
        assert all(a >= b for a, b in zip(r.accepted_at, r.accepted_at[1:]))
        if tree is None:  # a chain offers position k+1 only with position k
            assert all(a >= b for a, b in zip(r.offered_at, r.offered_at[1:]))
    assert any(r.accepted_tokens < r.drafted_tokens for r in results), "no draft was rejected"

    metrics = TargetMetrics("m", "alpha")
    for r in results:
        metrics.observe_request(request([r]))
    offered = by_position(metrics, "specpool_target_drafts_offered_total", "draft_model")
    accepted = by_position(metrics, "specpool_target_drafts_accepted_total", "draft_model")
    assert sum(offered.values()) == sum(r.drafted_tokens for r in results)
    assert sum(accepted.values()) == sum(r.accepted_tokens for r in results)
    assert set(offered) == set(range(1, max(len(r.offered_at) for r in results) + 1))


def test_positions_past_the_longest_round_count_at_the_last_label():
    from specpool.engine.decoding import GenerationResult

    r = GenerationResult([1])
    r.count_positions(range(MAX_DRAFT_TOKENS + 3), MAX_DRAFT_TOKENS + 1)
    metrics = TargetMetrics("m", "alpha")
    metrics.observe_request(request([r], Method.NGRAM))
    offered = by_position(metrics, "specpool_target_drafts_offered_total", "ngram")
    assert max(offered) == MAX_DRAFT_TOKENS and offered[MAX_DRAFT_TOKENS] == 4
    assert sum(offered.values()) == MAX_DRAFT_TOKENS + 3
    accepted = by_position(metrics, "specpool_target_drafts_accepted_total", "ngram")
    assert sum(accepted.values()) == MAX_DRAFT_TOKENS + 1


def test_decode_rate_by_method_is_tokens_after_the_first_over_the_time_since_it():
    from specpool.engine.decoding import GenerationResult

    metrics = TargetMetrics("m", "alpha")
    for method, seconds in ((Method.DRAFT_MODEL, 1.0), (Method.NONE, 4.0)):
        req = request([GenerationResult([1], token_ids=list(range(9))) for _ in range(2)], method, n=2)
        req.first_token_at, req.finished_at = 100.0, 100.0 + seconds
        metrics.observe_request(req)
    rate = {m: sample(metrics, "specpool_target_decode_tokens_total", method=m)
            / sample(metrics, "specpool_target_decode_seconds_total", method=m) for m in ("draft_model", "none")}
    assert rate == {"draft_model": 8.0, "none": 2.0}  # per sequence: 8 tokens after the first, in 1 s and 4 s
    assert sample(metrics, "specpool_target_generated_tokens_total") == 36


def test_prompt_tokens_and_queue_wait_count_at_admission():
    metrics = TargetMetrics("m", "alpha")
    req = request([], prompt=range(7))
    req.submitted_at = time.monotonic() - 2.0
    metrics.admitted(req, req.submitted_at + 2.0)
    assert sample(metrics, "specpool_target_prompt_tokens_total") == 7
    assert sample(metrics, "specpool_target_queue_wait_seconds_sum") == pytest.approx(2.0)
    assert sample(metrics, "specpool_target_queue_wait_seconds_bucket", le="1.0") == 0
    assert sample(metrics, "specpool_target_queue_wait_seconds_bucket", le="2.5") == 1


def test_every_fallback_reason_exists_before_the_first_fallback():
    metrics = TargetMetrics("m", "alpha")
    for reason in Fallback:
        assert metrics.registry.get_sample_value("specpool_target_spec_fallback_rounds_total",
                                                 {**LABELS, "reason": reason.value}) == 0.0
    metrics.predicted("draft_model", 1.7)
    assert sample(metrics, "specpool_target_predicted_speedup", method="draft_model") == 1.7


def test_plan_drops_are_counted_by_the_method_planned():
    from specpool.engine.decoding import GenerationResult

    metrics = TargetMetrics("m", "alpha")
    metrics.observe_request(request([GenerationResult([1], token_ids=[2, 3], plan_drops=2),
                                     GenerationResult([1], token_ids=[2])], Method.SSD))
    assert sample(metrics, "specpool_target_plan_drops_total", method="ssd") == 2
