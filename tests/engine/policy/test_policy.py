"""The hardware-aware draft length: from measured (or given) step costs and acceptance."""

import dataclasses
import json
import time

import pytest

from specpool.engine.decoding import generate
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.policy.acceptance import AcceptanceEstimate, expected_tokens
from specpool.engine.policy.costs import (
    BATCH_SIZES,
    StepCosts,
    batch_sizes_up_to,
    cached_step_costs,
    measure_step_costs,
)
from specpool.engine.policy.draft_length import (
    FixedDraftLength,
    Probe,
    RoundSlowdown,
    Running,
    SpeculationPolicy,
)
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

# A memory-bound target at batch 1 (verify cost flat in s) that turns compute-bound at batch 16.
COSTS = StepCosts(
    batch_sizes=(1, 16),
    draft_lens=(0, 4, 16),
    seconds=((0.030, 0.031, 0.035), (0.040, 0.150, 0.500)),
)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_step_costs_interpolate_and_extrapolate():
    assert COSTS(1, 2) == pytest.approx(0.0305)
    assert COSTS(8, 0) == pytest.approx(0.030 + 7 / 15 * 0.010)
    assert COSTS(32, 0) == pytest.approx(0.040 + 16 * 0.010 / 15)


def test_a_target_measures_the_batch_sizes_it_can_run():
    assert batch_sizes_up_to(8) == (1, 2, 4, 8)
    assert batch_sizes_up_to(12) == (1, 2, 4, 8, 16), "one past it: the heartbeat predicts at running + 1"
    assert batch_sizes_up_to(1) == (1, 2), "two at least, so the table extrapolates"
    assert batch_sizes_up_to(64) == BATCH_SIZES


def test_budget_shrinks_with_batch_size_and_acceptance():
    policy = SpeculationPolicy(COSTS, max_draft=16)
    at_1 = policy.choose(1, 0.8)
    at_16 = policy.choose(16, 0.8)
    assert at_1 >= 8 and at_16 < at_1
    assert policy.choose(16, 0.1) == 0  # does not pay: plain decoding
    assert policy.choose(1, 0.3) < at_1


def test_draft_model_cost_shortens_the_budget():
    free = SpeculationPolicy(COSTS, max_draft=16)
    costly = SpeculationPolicy(COSTS, draft_costs=StepCosts((1, 16), (0, 16), ((0.01, 0.01), (0.02, 0.02))))
    assert costly.choose(1, 0.8) < free.choose(1, 0.8)
    # By hand, batch 1, alpha 0.8: s=3 gives E=2.952 over 0.03075+0.03 s = 48.6 tok/s, s=4 gives
    # 3.362/0.071 = 47.4, s=2 gives 2.44/0.0505 = 48.3: s=3 is best.
    assert costly.choose(1, 0.8) == 3


def test_a_remote_rounds_wire_time_and_ssds_misses_are_charged():
    draft = StepCosts((1, 16), (0, 16), ((0.01, 0.01), (0.02, 0.02)))
    remote = SpeculationPolicy(COSTS, draft_costs=draft)
    assert remote.step_time(1, 3) == pytest.approx(COSTS(1, 3) + 3 * 0.01)
    assert remote.step_time(1, 0) == COSTS(1, 0)  # plain decoding pays neither
    slow_wire = dataclasses.replace(remote, round_s=0.05)
    assert slow_wire.step_time(1, 3) == pytest.approx(remote.step_time(1, 3) + 0.05)
    assert remote.choose(1, 0.8) == 3 and slow_wire.choose(1, 0.8) == 0  # the round trip eats the gain
    # SSD: only misses draft on the critical path. With every hit it drafts like a free drafter; with
    # none, like the draft model, which at batch 16 does not pay.
    ssd = [dataclasses.replace(remote, drafting_share=1 - hit) for hit in (1.0, 0.0)]
    assert ssd[0].choose(1, 0.8) == SpeculationPolicy(COSTS).choose(1, 0.8)
    assert ssd[1].choose(16, 0.6) == 0


def test_draft_model_starts_only_when_its_catch_up_pays_back():
    costly = SpeculationPolicy(COSTS, draft_costs=StepCosts((1, 16), (0, 16), ((0.01, 0.01), (0.02, 0.02))))
    # By hand, batch 1, alpha 0.8: s=3 runs at 48.6 tok/s, plain decoding at 33.3. Absorbing a
    # 101-token context costs 0.01 + (0.01/17) * 84 - 0.01 = 0.0494 s extra (feeds past the table
    # extrapolate at the longest step's per-token cost), won back after 0.0494 / (1/33.3 - 1/48.6)
    # = 5.2 tokens.
    assert costly.choose(1, 0.8, catch_up=101, remaining=4) == 0
    assert costly.choose(1, 0.8, catch_up=101, remaining=8) == 3
    assert costly.choose(1, 0.8, catch_up=1, remaining=1) == 3  # steady state: nothing to absorb


def test_measured_rows_are_made_non_decreasing():
    from specpool.engine.policy.costs import _non_decreasing

    # A noisy dip (s=2 measured cheaper than s=1) is pooled with its neighbour, by hand: (5+3)/2 = 4.
    assert _non_decreasing([1.0, 5.0, 3.0, 6.0]) == [1.0, 4.0, 4.0, 6.0]
    assert _non_decreasing([1.0, 2.0]) == [1.0, 2.0]


def test_acceptance_estimate_is_geometric_for_iid_drafts():
    est = AcceptanceEstimate(prior_weight=0.0, decay=1.0)
    for _ in range(100):  # alpha = 1/2: of 8 rounds of 3 drafts, by position reached
        for accepted in (0, 0, 0, 0, 1, 1, 2, 3):
            est.update(accepted=accepted, offered=3, drafted=3)
    assert est.expected_tokens(3) == pytest.approx(expected_tokens(0.5, 3))
    assert est.expected_tokens(5) == pytest.approx(expected_tokens(0.5, 5))  # unmeasured: as the last


def test_acceptance_estimate_sees_runs_that_one_alpha_misses():
    # n-gram style: a draft either matches a copied run to the end or fails at once.
    est = AcceptanceEstimate(prior_weight=0.0, decay=1.0)
    for accepted in (0, 4, 0, 4):
        est.update(accepted=accepted, offered=4, drafted=4)
    # P(accept) by position: 1/2, then 1, 1, 1 (and 1 beyond): E(s) = 1 + s/2, by hand.
    assert [est.expected_tokens(s) for s in (0, 1, 2, 4, 8)] == [1.0, 1.5, 2.0, 3.0, 5.0]
    # One alpha with the same accepted/rejected counts (8 accepted, 2 rejections: 0.8) predicts
    # fewer tokens from long drafts; the policy, given the measured curve, drafts longer.
    assert expected_tokens(0.8, 8) < est.expected_tokens(8)
    costs = StepCosts((1,), tuple(range(17)), (tuple(0.1 + 0.01 * s for s in range(17)),))
    policy = SpeculationPolicy(costs, max_draft=16)
    assert policy.choose(1, est.expected_tokens) == 16 > policy.choose(1, 0.8)


def test_acceptance_estimate_starts_at_its_prior_and_forgets():
    est = AcceptanceEstimate(prior_alpha=0.5, prior_weight=2.0, decay=0.9)
    assert est.expected_tokens(2) == pytest.approx(1.75)
    for _ in range(200):
        est.update(accepted=0, offered=2, drafted=2)
    assert est.expected_tokens(2) < 1.2  # position 0: (0 + 2 * 0.5) / (10 + 2) = 0.08
    for _ in range(200):
        est.update(accepted=2, offered=2, drafted=2)
    assert est.expected_tokens(2) > 2.6  # (10 + 1) / 12 = 0.92, then (10 + 2 * 0.92) / 12 = 0.99


def test_rounds_without_drafts_fade_back_to_the_prior():
    est = AcceptanceEstimate(prior_alpha=0.5, prior_weight=2.0, decay=0.9)
    for _ in range(5):
        est.update(accepted=0, offered=4, drafted=4)
    assert est.expected_tokens(4) < 1.3  # a policy would stop drafting here, and measure nothing more
    for _ in range(100):
        est.update(accepted=0, offered=0, drafted=0)
    assert est.expected_tokens(4) == pytest.approx(expected_tokens(0.5, 4), rel=1e-3)  # so it tries again


def test_measured_costs_are_cached_and_a_stale_table_is_measured_again(tiny_model, tmp_path):
    kwargs = {"batch_sizes": (1, 4), "draft_lens": (0, 2), "context_len": 16, "repeats": 1}
    first = cached_step_costs(tiny_model, "tiny", tmp_path, **kwargs)
    assert all(t > 0 for row in first.seconds for t in row)
    [path] = tmp_path.iterdir()
    data = json.loads(path.read_text())

    def cached_with(scale: float) -> StepCosts:
        path.write_text(json.dumps(data | {"seconds": [[t * scale for t in row] for row in data["seconds"]]}))
        return cached_step_costs(tiny_model, "tiny", tmp_path, **kwargs)

    fast = cached_with(1e-6)  # faster than any check: the cached table is used as it is
    assert fast.seconds == tuple(tuple(t * 1e-6 for t in row) for row in data["seconds"])
    slow = cached_with(1e3)  # measured under load: measured again, and the file replaced
    assert slow(1, 0) < first(1, 0) * 100 and json.loads(path.read_text())["seconds"] == [list(r) for r in slow.seconds]


def test_a_model_retrained_under_the_same_name_gets_a_table_of_its_own(tiny_model, tmp_path):
    """Keyed by its name alone, a head retrained into its directory read the old head's costs for good."""
    kwargs = {"batch_sizes": (1,), "draft_lens": (0,), "context_len": 8, "repeats": 1}
    retrained = Llama.random_init(tiny_model.config, seed=1)
    assert retrained.fingerprint != tiny_model.fingerprint
    assert Llama.random_init(tiny_model.config, seed=0).fingerprint == tiny_model.fingerprint
    cached_step_costs(tiny_model, "tiny", tmp_path, **kwargs)
    cached_step_costs(retrained, "tiny", tmp_path, **kwargs)
    assert len(list(tmp_path.iterdir())) == 2


def test_policy_driven_generation_stays_lossless(tiny_model):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11]]
    ar = generate(tiny_model, prompts, SamplingParams(), 20, stop_ids=[])
    spec = generate(tiny_model, prompts, SamplingParams(), 20, NgramDrafter(), stop_ids=[],
                    policy=SpeculationPolicy(COSTS, max_draft=8))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert sum(r.drafted_tokens for r in spec) > 0


# An AVX2 CPU in fp32: the first draft already costs half a step more, at every batch size.
AVX2_LIKE = StepCosts(batch_sizes=(1, 16), draft_lens=(0, 1, 4, 8),
                      seconds=((0.034, 0.053, 0.060, 0.066), (0.090, 0.135, 0.150, 0.170)))


def test_offers_left_empty_are_rejections_and_cost_a_plain_step_only_when_no_row_drafts():
    """An n-gram index that matches 15% of contexts: the yield counts the empty offers, the cost
    counts a plain step when no row drafted. At batch 1 that is most rounds (speculate); at batch 16
    almost no round has all rows empty (do not)."""
    est = AcceptanceEstimate(prior_weight=0.0, decay=1.0)
    for i in range(100):
        filled = i % 20 < 3
        est.update(accepted=4 if filled else 0, offered=4, drafted=4 if filled else 0)
    assert est.fill == pytest.approx(0.15)
    assert est.expected_tokens(4) == pytest.approx(1 + 4 * 0.15)
    policy = SpeculationPolicy(AVX2_LIKE, max_draft=4)
    assert policy.choose(1, est.expected_tokens, fill=est.fill) == 4
    assert policy.choose(1, est.expected_tokens) == 0  # charged as if every round drafted: no gain
    assert policy.choose(16, est.expected_tokens, fill=est.fill) == 0


def test_a_policy_offers_its_batch_one_length_from_the_mean_catch_up_and_remaining_tokens():
    policy = SpeculationPolicy(COSTS, draft_costs=COSTS)
    acceptance = AcceptanceEstimate(prior_alpha=0.8)
    batch = [Running("a", unseen=1, remaining=40), Running("b", unseen=3, remaining=20)]
    s = policy.choose(2, acceptance.expected_tokens, catch_up=2.0, remaining=30.0, fill=acceptance.fill)
    assert policy.lengths(batch, acceptance) == [s, s]
    assert policy.lengths([], acceptance) == []
    assert FixedDraftLength(3).lengths(batch, acceptance) == [3, 3]


def test_round_slowdown_learns_each_kind_of_round_and_leans_speculation_back_on_plain():
    slowdown = RoundSlowdown(decay=0.9, prior_weight=0.1)
    assert slowdown.ratio(speculative=False) == slowdown.ratio(speculative=True) == 1.0
    for _ in range(50):
        slowdown.expect(False, 0.010)
        slowdown.observe(0.012)
    assert slowdown.ratio(speculative=False) == pytest.approx(1.2, rel=0.01)
    assert slowdown.ratio(speculative=True) == pytest.approx(1.2, rel=0.01)  # none measured: as plain
    for _ in range(50):
        slowdown.expect(True, 0.010)
        slowdown.observe(0.020)
    assert slowdown.ratio(speculative=True) == pytest.approx(2.0, rel=0.01)
    slowdown.observe(1.0)  # nothing expected (a side step): ignored
    assert slowdown.ratio(speculative=True) == pytest.approx(2.0, rel=0.01)
    for _ in range(100):  # rounds of requests planned to plain decoding: the policy chose nothing
        slowdown.expect(False, 0.010, chosen=False)
        slowdown.observe(0.012)
    assert slowdown.ratio(speculative=True) == pytest.approx(2.0, rel=0.01)
    for _ in range(100):
        slowdown.expect(False, 0.010)
        slowdown.observe(0.012)
    assert slowdown.ratio(speculative=True) < 1.3  # stopped speculating: leans back on plain, tries again



def test_round_slowdown_learns_each_batch_size_apart_from_the_others():
    """Through the servers the Qwen pair's plain rounds at batch 4 ran further over their table than batch 1's;
    learned into one ratio, batch 4's rounds priced plain decoding at batch 1 too slow, and the heartbeat's
    speedups at batch 1 rose to 1.28x (draft model) and 1.37x (n-gram). Each bucket learns its own ratio, leaning
    on all batches' until it has rounds of its own; speculation's overhead over plain rounds carries across."""
    def learned(with_batch_4: bool) -> SpeculationPolicy:
        policy = SpeculationPolicy(COSTS, max_draft=4, slowdown=RoundSlowdown())
        for _ in range(200):
            policy.slowdown.expect(False, 0.010, batch_size=1)
            policy.slowdown.observe(0.011)
            if with_batch_4:  # a request planned to plain decoding beside others (routed AR)
                policy.slowdown.expect(False, 0.040, chosen=False, batch_size=4)
                policy.slowdown.observe(0.060)
            policy.slowdown.expect(True, 0.020, batch_size=1)
            policy.slowdown.observe(0.026)  # speculative rounds at batch 1 run 1.3/1.1 plain rounds' overhead
        return policy

    slowdown = learned(with_batch_4=True).slowdown
    assert slowdown.ratio(False, 1) == pytest.approx(1.1, rel=0.02)
    assert slowdown.ratio(False, 3) == slowdown.ratio(False, 4) == pytest.approx(1.5, rel=0.02)
    assert slowdown.ratio(False, 8) == slowdown.ratio(False), "a bucket with no rounds: all batches' ratio"
    assert slowdown.ratio(True, 1) == pytest.approx(1.3, rel=0.02)
    assert slowdown.ratio(True, 4) / slowdown.ratio(False, 4) == pytest.approx(1.3 / 1.1, rel=0.02)
    # The policy's speedup at batch 1 is priced by batch 1's rounds, whatever ran at batch 4 meanwhile.
    assert learned(True).speedup(1, 0.8)[1] == pytest.approx(learned(False).speedup(1, 0.8)[1], rel=0.02)

def test_a_policy_stops_speculating_when_its_rounds_run_slower_than_the_table_and_tries_again_later():
    policy = SpeculationPolicy(COSTS, max_draft=4, slowdown=RoundSlowdown(decay=0.8))
    batch, acceptance = [Running("a", 0, 100)], AcceptanceEstimate(prior_alpha=0.2, prior_weight=1e9)
    # The table: 1.25 tokens per 30.8 ms step against 1 per 30 ms: 1.22x, above the 1.1 margin.
    [s] = policy.lengths(batch, acceptance)
    assert s > 0
    for _ in range(10):  # each speculative round takes 1.3x its prediction, each plain one its own
        [s] = policy.lengths(batch, acceptance)
        policy.observe(1.3 * policy.step_time(1, s))
        if s == 0:
            break
    assert s == 0
    for _ in range(30):
        [s] = policy.lengths(batch, acceptance)
        policy.observe(policy.step_time(1, s))
        if s > 0:
            break
    assert s > 0


class _SlowNgramDrafter(NgramDrafter):
    """A real n-gram drafter whose every proposal takes `delay` seconds more (a slow drafter)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay
        self.proposals = 0

    def propose(self, seq_ids, num_tokens, params, generator):
        self.proposals += 1
        time.sleep(self.delay)
        return super().propose(seq_ids, num_tokens, params, generator)


def test_the_decoder_tells_the_policy_what_rounds_took_so_a_slow_drafter_is_dropped(tiny_model):
    """The table says drafting is free and verifying costs a plain step; each proposal takes 30 plain
    steps more, so even 3 tokens a round lose. The decoder must report each round with its drafting,
    and the policy stop asking; the output stays AR's."""
    plain = measure_step_costs(tiny_model, (1,), (0,), context_len=16).seconds[0][0]
    policy = SpeculationPolicy(StepCosts((1,), (0, 8), ((plain, plain),)), max_draft=2)
    prompt = [[5, 6, 7, 8] * 4]
    ar = generate(tiny_model, prompt, SamplingParams(), 40, stop_ids=[])
    slow = _SlowNgramDrafter(delay=30 * plain)
    [spec] = generate(tiny_model, prompt, SamplingParams(), 40, slow, stop_ids=[], policy=policy,
                      acceptance=AcceptanceEstimate(prior_alpha=0.9))
    assert spec.token_ids == ar[0].token_ids
    assert policy.slowdown.ratio(speculative=True) > 10  # the rounds' drafting reached the policy
    assert 1 <= slow.proposals < spec.target_steps / 2  # and it stopped asking (it may try again later)


def test_a_prior_below_break_even_still_probes_and_a_good_drafter_is_found():
    """The estimate alone would never draft (its prior prices drafting under MIN_GAIN), so it would never
    learn: every 16th plain round probes, and once the drafts are seen accepted the policy drafts on."""
    policy = SpeculationPolicy(COSTS, draft_costs=StepCosts((1, 16), (0, 16), ((0.012, 0.012), (0.012, 0.012))),
                               max_draft=8)
    acceptance = AcceptanceEstimate()
    batch = [Running("a", 0, 1000)]
    assert policy.choose(1, acceptance.expected_tokens) == 0
    lengths = []
    for _ in range(64):
        [s] = policy.lengths(batch, acceptance)
        lengths.append(s)
        acceptance.update(accepted=s, offered=s, drafted=s)  # every draft accepted
    assert lengths[:15] == [0] * 15 and lengths[15] > 0  # the probe
    assert all(s > 0 for s in lengths[16:])  # learned: drafts every round


@pytest.mark.parametrize("accepted", [True, False], ids=["a good drafter", "a bad one"])
def test_a_probe_told_to_probes_its_first_plain_round_too(accepted):
    """A target's draft-model policy: a router's probe may be a request shorter than 16 rounds."""
    policy = SpeculationPolicy(COSTS, draft_costs=StepCosts((1, 16), (0, 16), ((0.012, 0.012), (0.012, 0.012))),
                               max_draft=8, probe=Probe(first=True))
    acceptance = AcceptanceEstimate()
    lengths = []
    for _ in range(40):
        [s] = policy.lengths([Running("a", 0, 1000)], acceptance)
        lengths.append(s)
        acceptance.update(accepted=s if accepted else 0, offered=s, drafted=s)
    if accepted:
        assert all(s > 0 for s in lengths)  # learned from the first round on
    else:
        assert [i for i, s in enumerate(lengths) if s > 0] == [0, 16, 32]


def test_no_probe_where_even_accepted_drafts_could_not_pay():
    """A probe drafts for every sequence of the batch after each has sat out 16 rounds; where verifying more
    tokens costs so much that drafts all accepted would not pay (the Qwen pair at batch 16: one more token a
    sequence 1.86x a plain step), its catch-up is pure loss, so it never probes there, and still does at batch 1."""
    target = StepCosts((1, 16), (0, 1, 8), ((0.040, 0.042, 0.058), (0.080, 0.150, 0.700)))
    draft = StepCosts((1, 16), (0, 8), ((0.010, 0.020), (0.030, 0.200)))
    for n, probes in ((16, False), (1, True)):
        policy = SpeculationPolicy(target, draft_costs=draft, max_draft=8)
        batch = [Running(str(i), 0, 1000) for i in range(n)]
        lengths = [policy.lengths(batch, AcceptanceEstimate())[0] for _ in range(48)]
        assert policy.could_pay(n) is probes and any(lengths) is probes, lengths
