"""SSD in-process: the speculation cache is hit, greedy output equals AR, sampling stays lossless.

`Inline` runs SSD sequentially (pre-speculation right after drafts are handed out, before the
target verifies them), which exercises exactly the endpoint's cache, forks and backups.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from specpool.engine.config import tiny_config
from specpool.engine.decoding import generate
from specpool.engine.model import Llama, random_weights
from specpool.engine.sampling import SamplingParams, logits_to_probs, make_generator
from specpool.engine.ssd import SsdDrafter
from specpool.engine.ssd_stats import geometric_fanout
from tests.stats import cells, check_tv, exact_joint, report
from tests.twins import biased


class Inline:
    """The Drafter protocol over an SsdDrafter, pre-speculating after every propose. `sources`
    records where each sequence's drafts came from, round by round (cache, neural or fast)."""

    def __init__(self, ssd: SsdDrafter):
        self.ssd, self.inputs = ssd, ssd.inputs  # a head's features travel through (start, observe)
        self.sources: dict[str, list[str]] = defaultdict(list)

    def start(self, seq_id, context, **inputs):
        self.ssd.start(seq_id, context, **inputs)

    def observe(self, seq_id, tokens, **inputs):
        self.ssd.observe(seq_id, tokens, **inputs)

    def release(self, seq_id):
        self.ssd.release(seq_id)

    def propose(self, seq_ids, num_tokens, params, generator):
        drafts = self.ssd.propose(seq_ids, num_tokens, params, generator)
        for sid, tokens in zip(seq_ids, drafts.tokens):
            if tokens:  # as the decoder's round log counts a round with drafts
                self.sources[sid].append(self.ssd._seqs[sid].source)
        self.ssd.prespeculate([s for s, n in zip(seq_ids, num_tokens) if n > 0])
        return drafts


def test_geometric_fanout_by_hand():
    # a = 0.5, r = 1: weights 0.5^(k/2) for k = 0, 1 and, for k = K = 2, 0.5^1 * 0.5^(-1/2):
    # 1, 0.707, 0.707 -> shares 0.414, 0.293, 0.293 of 8 forks = 3.31, 2.34, 2.34 -> 3, 2, 2, and the
    # leftover fork goes to the largest remainder (0.34, the first of the tie: k = 1).
    assert geometric_fanout(8, 2, 0.5, 1.0) == [3, 3, 2]
    assert sum(geometric_fanout(13, 5, 0.8, 0.7)) == 13


def test_a_draft_equal_to_the_target_hits_the_cache_and_greedy_equals_ar(tiny_model):
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    ar = generate(tiny_model, prompts, SamplingParams(), 30, stop_ids=[])
    ssd = SsdDrafter(tiny_model, len(prompts), 64, fork_slots=32, fork_budget=4)
    out = generate(tiny_model, prompts, SamplingParams(), 30, Inline(ssd), 3, stop_ids=[])
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    # Every model draft is accepted, so the outcome is (K, top-1 after dK): in the cache once the
    # fan-out has learnt that acceptance is high (the first rounds start from a = 0.5).
    assert ssd.stats.lookups > 10 and ssd.stats.hit_ratio > 0.8
    assert ssd.stats.bonus_top1 == ssd.stats.lookups
    assert ssd.cache.free_slots == ssd.cache.max_slots, "forks and sequences give their slots back"


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_greedy_equals_ar_with_a_different_draft_on_hits_and_misses(tiny_model, backup):
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=5)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10], [12, 13, 14]]
    ar = generate(tiny_model, prompts, SamplingParams(), 40, stop_ids=[])
    ssd = SsdDrafter(draft, len(prompts), 96, fork_slots=48, fork_budget=8, backup=backup)
    out = generate(tiny_model, prompts, SamplingParams(), 40, Inline(ssd), 3, stop_ids=[])
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert 0 < ssd.stats.hits < ssd.stats.lookups, "both paths ran"


def test_forks_per_sequence_follow_the_verify_time(tiny_model):
    ssd = SsdDrafter(tiny_model, 1, 64, fork_budget=6)
    assert ssd.forks == 3
    ssd._size_forks(0.050)  # no verify time measured yet: unchanged
    assert ssd.forks == 3
    ssd.stats.verify_s = 0.100
    ssd._size_forks(0.090)  # overran 80% of the verify time: one fork fewer
    assert ssd.forks == 2
    ssd._size_forks(0.070)  # inside the share, above 75% of it: kept
    assert ssd.forks == 2
    for _ in range(10):  # well inside: one more each pass, up to the budget
        ssd._size_forks(0.010)
    assert ssd.forks == 6
    for _ in range(10):
        ssd._size_forks(0.500)
    assert ssd.forks == 1


def test_drafts_from_the_cache_equal_fresh_greedy_drafts_of_the_same_context(tiny_model):
    """A fork's KV cache must hold exactly context + d1..dk + b (+ its own fed drafts): drafts it
    hands out, and every draft after it, equal the draft model's greedy drafts from scratch. (A
    fork that lost one fed token still gave lossless output, but drafts that lagged the context.)"""
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=5)
    context: dict[str, list[int]] = {}
    checked = {"cache": 0, "neural": 0}

    class Checked(Inline):
        def start(self, seq_id, tokens):
            context[seq_id] = list(tokens)
            super().start(seq_id, tokens)

        def observe(self, seq_id, tokens):
            context[seq_id] += list(tokens)
            super().observe(seq_id, tokens)

        def propose(self, seq_ids, num_tokens, params, generator):
            drafts = super().propose(seq_ids, num_tokens, params, generator)
            for sid, got in zip(seq_ids, drafts.tokens):
                cache = draft.new_cache(1, 128)
                slot, feed, fresh = cache.allocate(), context[sid], []
                for _ in got:
                    fresh.append(int(draft.forward(cache, [slot], [feed]).argmax(-1)[0]))
                    feed = fresh[-1:]
                assert got == fresh, f"{self.ssd._seqs[sid].source} drafts {got} != fresh {fresh}"
                checked[self.ssd._seqs[sid].source] += 1
            return drafts

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10], [12, 13, 14]]
    ssd = SsdDrafter(draft, len(prompts), 96, fork_slots=48, fork_budget=8, backup="neural")
    generate(tiny_model, prompts, SamplingParams(), 40, Checked(ssd), 3, stop_ids=[])
    assert checked["cache"] > 5 and checked["neural"] > 5, checked


def test_outcomes_a_target_rarely_sends_leave_the_cache_equal_to_the_context():
    """Found fuzzing the endpoint: accepted drafts with no bonus, a hit then an outcome with no new tokens,
    and local drafts after a hit the target did not see left nothing to feed ("a row needs at least one
    token", failing every session drafted with it) or the glue a row short (IndexError in pre-speculation,
    failing every SSD session's). After each, the next drafts equal fresh greedy drafts of the context."""
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=5)
    ssd = SsdDrafter(draft, 1, 96, fork_slots=16, fork_budget=4, backup="neural")
    context = [5, 6, 7, 8, 5, 6]
    ssd.start("s", context)

    def drafts() -> list[int]:
        got = ssd.propose(["s"], [3], SamplingParams(), None).tokens[0]
        ssd.prespeculate(["s"])
        cache = draft.new_cache(1, 128)
        slot, feed, fresh = cache.allocate(), context, []
        for _ in got:
            fresh.append(int(draft.forward(cache, [slot], [feed]).argmax(-1)[0]))
            feed = fresh[-1:]
        assert got == fresh
        return got

    def outcome(tokens: list[int]) -> None:
        context.extend(tokens)
        ssd.observe("s", tokens)

    def a_hit(d: list[int]) -> list[int]:
        k, bonus = next(iter(ssd.outcome_table("s")))
        return d[:k] + [bonus]

    outcome(drafts()[:1])  # the first draft accepted, no bonus
    outcome(a_hit(drafts()))
    outcome([])
    d = drafts()
    outcome(a_hit(d))
    ssd.adopt("s", [9, 10])  # the target missed the hit and drafts on its own
    ssd.prespeculate(["s"])
    outcome([9, 11])
    drafts()


def test_a_sequence_at_the_end_of_the_cache_is_drafted_on_demand_not_pre_speculated():
    """Found fuzzing the endpoint: a session as long as the draft's context (--max-len = its max_context)
    handed out drafts that filled the cache, and the glue before pre-speculating fed one position more
    (ValueError in the forward, failing every SSD session's pre-speculation in that step)."""
    config = replace(tiny_config(vocab_size=64, n_layers=1), max_context=24)
    draft = Llama.random_init(config, seed=5)
    ssd = SsdDrafter(draft, 1, 64, fork_slots=16, fork_budget=4, backup="neural")
    assert ssd.cache.max_len == 24
    context = list(range(1, 23))
    ssd.start("s", context)
    drafts = ssd.propose(["s"], [3], SamplingParams(), None).tokens[0]
    assert ssd.cache.lengths[ssd._seqs["s"].slot] == 24
    ssd.prespeculate(["s"])
    assert ssd.outcome_table("s") == {}, "no room for forks: nothing pre-speculated"
    ssd.observe("s", drafts[:1] + [7])
    assert ssd.propose(["s"], [1], SamplingParams(), None).tokens[0] and ssd._seqs["s"].source == "neural"


# -- lossless sampling ---------------------------------------------------------------------------------

V = 8
N = 100_000
CHUNK = 10_000
K, NEW = 2, 5  # tokens 3-4 (0-based 2, 3) mostly come from the second round, drafted from the cache
PROMPT = [3, 1, 4, 1, 5]
CONFIG = tiny_config(vocab_size=V, d_model=16)
DRAFT_CONFIG = tiny_config(vocab_size=V, d_model=16, n_layers=1)
# Both flattened (final norm scaled down): a random tiny model is nearly one-hot otherwise, which would
# hide a bias, and Saguaro's rescaling of the draft's top tokens would change too little to show.
TARGET = Llama(CONFIG, random_weights(CONFIG, 11) | {"norm": 0.3 * torch.ones(16)}, torch.float32, "cpu")
DRAFT = Llama(DRAFT_CONFIG, random_weights(DRAFT_CONFIG, 12) | {"norm": 0.15 * torch.ones(16)}, torch.float32, "cpu")


def scored_sources(result, sources: list[str], first: int = 2, last: int = 3) -> set[str]:
    """Where the drafts of the rounds that emitted tokens first..last came from ("plain": no drafts)."""
    pos, drafted_rounds, out = 1, iter(sources), set()
    for drafted, accepted in result.rounds:
        source = next(drafted_rounds) if drafted else "plain"
        if pos <= last and pos + accepted >= first:
            out.add(source)
        pos += accepted + 1
    return out


def ssd_check(name: str, params: SamplingParams, ssd_kwargs: dict, drafter_cls=SsdDrafter):
    """-> (TV check of tokens 3-4, shares of rows whose scored tokens came through a cache hit / a miss)."""
    gen = make_generator(1)
    pairs, through = [], []
    for _ in range(N // CHUNK):
        ssd = drafter_cls(DRAFT, CHUNK, 16, fork_slots=4 * CHUNK, fork_budget=4, **ssd_kwargs)
        ssd.generator.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        inline = Inline(ssd)
        results = generate(TARGET, [PROMPT] * CHUNK, params, NEW, inline, K, stop_ids=[], generator=gen)
        pairs += [r.token_ids[2:4] for r in results]
        through += [scored_sources(r, inline.sources[str(i)]) for i, r in enumerate(results)]
    shares = {"cache hit": sum("cache" in s for s in through) / N,
              "miss": sum(bool(s & {"neural", "fast"}) for s in through) / N}
    exact = exact_joint(TARGET, PROMPT, params, 2, 3)
    assert exact.max() < 0.5, "a near-one-hot target would hide a bias"
    return check_tv(name, cells(pairs, 0, 1, V), exact), shares


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "saguaro_c"), [(0.7, 1.0), (1.0, 0.3)])
def test_sampling_through_ssd_is_lossless(temperature, saguaro_c):
    result, shares = ssd_check(f"SSD T={temperature} C={saguaro_c}", SamplingParams(temperature=temperature),
                               {"saguaro_c": saguaro_c})
    report(result, **shares)
    assert shares["cache hit"] > 0.3 and shares["miss"] > 0.05, shares
    assert result.passed, result


class UnrescaledQ(SsdDrafter):
    """Samples with Saguaro's rescaling but reports q as if it had not: the classic biased verifier input."""

    def _sample(self, logits, params):
        picked, _, _ = super()._sample(logits, params)
        top = torch.topk(logits_to_probs(logits, params), min(self.q_top_k, logits.shape[-1]), dim=-1)
        return picked, top.indices, top.values / top.values.sum(-1, keepdim=True)


@pytest.mark.slow
def test_the_harness_catches_a_misreported_saguaro_q():
    twin, shares = ssd_check("SSD T=1.0 C=0.1, Saguaro q unrescaled", SamplingParams(temperature=1.0),
                             {"saguaro_c": 0.1}, UnrescaledQ)
    report(twin, twin=True, **shares)
    assert not twin.passed, f"biased twin slipped through: {twin}"


@pytest.mark.slow
def test_the_harness_catches_a_twin_near_its_limit_on_the_cache_path():
    """C = 1.0, T = 0.7; only drafts served from the cache misreport q."""
    with biased("misreported-cache-q", 0.15):
        twin, shares = ssd_check("SSD T=0.7 C=1.0, misreported-cache-q 0.15", SamplingParams(temperature=0.7),
                                 {"saguaro_c": 1.0})
    report(twin, twin=True, **shares)
    assert not twin.passed, f"biased twin slipped through: {twin}"
