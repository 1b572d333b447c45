"""SSD in-process: the speculation cache is hit, greedy output equals AR, sampling stays lossless.

`Inline` runs SSD sequentially (pre-speculation right after drafts are handed out, before the
target verifies them), which exercises exactly the endpoint's cache, forks and backups.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.drafters.base import Capabilities, Drafter
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.drafters.ssd import SsdDrafter
from specpool.engine.drafters.ssd_stats import geometric_fanout
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs, make_generator
from tests.stats import assert_through_the_path, cells, check_tv, exact_joint, report, rows
from tests.twins import biased


class Inline(Drafter):
    """The Drafter protocol over an SsdDrafter, pre-speculating after every propose. `sources`
    records where each sequence's drafts came from, round by round (cache, neural or fast)."""

    def __init__(self, ssd: SsdDrafter):
        # A head's features travel through (start, observe).
        self.ssd, self.caps = ssd, Capabilities(features=ssd.caps.features)
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
    ssd = SsdDrafter(tiny_model, len(prompts), 64, fork_slots=32, fork_budget=4, fast=NgramDrafter())
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
    ssd = SsdDrafter(draft, len(prompts), 96, fork_slots=48, fork_budget=8, backup=backup, fast=NgramDrafter())
    out = generate(tiny_model, prompts, SamplingParams(), 40, Inline(ssd), 3, stop_ids=[])
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert 0 < ssd.stats.hits < ssd.stats.lookups, "both paths ran"
    assert ssd.stats.backups[backup] > 0, f"misses were drafted by the {backup} backup"


def test_forks_per_sequence_follow_the_verify_time(tiny_model):
    ssd = SsdDrafter(tiny_model, 1, 64, fork_budget=6)
    assert ssd.forks == 3
    ssd._size_forks(0.050, 4)  # no verify time measured yet: unchanged
    assert ssd.forks == 3
    ssd.stats.verify_s = 0.100
    ssd._size_forks(0.090, 4)  # overran 80% of the verify time: one fork fewer
    assert ssd.forks == 2
    ssd._size_forks(0.070, 4)  # inside the share, above 75% of it: kept
    assert ssd.forks == 2
    for _ in range(10):  # well inside: one more each pass, up to the budget
        ssd._size_forks(0.010, 4)
    assert ssd.forks == 6
    for _ in range(10):
        ssd._size_forks(0.500, 4)
    assert ssd.forks == 1


def test_forks_per_sequence_stop_where_the_measured_hits_stop_growing(tiny_model):
    ssd = SsdDrafter(tiny_model, 1, 64, fork_budget=16)
    ssd.stats.verify_s, ssd.stats.accept_ema = 0.100, 0.5
    for _ in range(20):  # passes well inside the verify time, no bonus ranks measured yet: up to the budget
        ssd._size_forks(0.010, 4)
    assert ssd.forks == 16
    # The real bonus was the row's first candidate 9 times in 10, its second otherwise: past a fork or two
    # per accepted length, more forks buy (almost) no hits.
    ssd.stats.bonus_ranks[0], ssd.stats.bonus_ranks[1] = 90, 10
    ssd._size_forks(0.010, 4)
    cap = ssd.stats.useful_forks(4, 16)
    assert ssd.forks == cap and 5 <= cap < 16
    hit = ssd.stats.expected_hits(16, 4)[cap - 1 :]
    assert hit[1] - hit[0] >= 0.01, "the last fork kept was worth a point of hits"
    assert all(h - hit[1] < 0.01 * g for g, h in enumerate(hit[2:], 1)), "no later count repays its forks"
    # A flat curve (the bonus anywhere among 16 candidates) repays about every fork of the budget.
    ssd.stats.bonus_ranks[:16] = [10] * 16
    for _ in range(16):
        ssd._size_forks(0.010, 4)
    assert ssd.forks >= 14


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
STRONG_TWIN_ROWS = rows(20_000, 10_000)  # Saguaro q unrescaled: 5.4x its threshold at 20k rows
TV_ROWS = rows(N, STRONG_TWIN_ROWS)  # the lossless tests (tests/stats.py's two tiers)
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


def ssd_check(name: str, params: SamplingParams, ssd_kwargs: dict, drafter_cls=SsdDrafter,
              models: tuple[Llama, Llama] = (TARGET, DRAFT), scored: tuple[int, int] = (2, 3), rows: int = N):
    """-> (TV check of the scored tokens (default 3-4), shares of rows whose scored tokens came
    through a cache hit / a miss) and the drafters of every chunk."""
    target, draft = models
    vocab, gen = target.config.vocab_size, make_generator(1)
    windows, through, drafters = [], [], []
    for _ in range(rows // CHUNK):
        ssd = drafter_cls(draft, CHUNK, 16, fork_slots=4 * CHUNK, fork_budget=4, **ssd_kwargs)
        ssd.generator.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        inline = Inline(ssd)
        results = generate(target, [PROMPT] * CHUNK, params, NEW, inline, K, stop_ids=[], generator=gen)
        windows += [r.token_ids[scored[0]:scored[1] + 1] for r in results]
        through += [scored_sources(r, inline.sources[str(i)], *scored) for i, r in enumerate(results)]
        drafters.append(ssd)
    shares = {"cache hit": sum("cache" in s for s in through) / rows,
              "miss": sum(bool(s & {"neural", "fast"}) for s in through) / rows,
              "drafted": sum(bool(s & {"cache", "neural"}) for s in through) / rows}  # q sampled by SSD's model
    exact = exact_joint(target, PROMPT, params, *scored)
    assert exact.max() < 0.5, "a near-one-hot target would hide a bias"
    return check_tv(name, cells(windows, 0, scored[1] - scored[0], vocab), exact), shares, drafters


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "saguaro_c"), [(0.7, 1.0), (1.0, 0.3)])
def test_sampling_through_ssd_is_lossless(temperature, saguaro_c):
    result, shares, _ = ssd_check(f"SSD T={temperature} C={saguaro_c}", SamplingParams(temperature=temperature),
                                  {"saguaro_c": saguaro_c}, rows=TV_ROWS)
    report(result, **shares)
    assert_through_the_path(shares, result.n)  # about 0.31 of the rows are hits at T 0.7, C 1.0
    assert shares["miss"] > 0.05, shares
    assert result.passed, result


class UnrescaledQ(SsdDrafter):
    """Samples with Saguaro's rescaling but reports q as if it had not: the classic biased verifier input."""

    def _sample(self, logits, params):
        picked, _, _ = super()._sample(logits, params)
        top = torch.topk(logits_to_probs(logits, params), min(self.q_top_k, logits.shape[-1]), dim=-1)
        return picked, top.indices, top.values / top.values.sum(-1, keepdim=True)


@pytest.mark.slow
def test_the_harness_catches_a_misreported_saguaro_q():
    twin, shares, _ = ssd_check("SSD T=1.0 C=0.1, Saguaro q unrescaled", SamplingParams(temperature=1.0),
                                {"saguaro_c": 0.1}, UnrescaledQ, rows=STRONG_TWIN_ROWS)
    report(twin, twin=True, at_n=TV_ROWS, **shares)
    assert_through_the_path(shares, twin.n, path="drafted")  # every sampled draft, cached or not, misreports q
    assert not twin.passed, f"biased twin slipped through: {twin}"


@pytest.mark.slow
@pytest.mark.full_power
def test_the_harness_catches_a_twin_near_its_limit_on_the_cache_path():
    """C = 1.0, T = 0.7; only drafts served from the cache misreport q."""
    with biased("misreported-cache-q", 0.15):
        twin, shares, _ = ssd_check("SSD T=0.7 C=1.0, misreported-cache-q 0.15", SamplingParams(temperature=0.7),
                                    {"saguaro_c": 1.0})
    report(twin, twin=True, **shares)
    assert_through_the_path(shares, twin.n)  # the bias lives on the cache path alone
    assert not twin.passed, f"biased twin slipped through: {twin}"


# -- the top-32 cut: a vocabulary larger than q_top_k -----------------------------------------------------

WIDE_V = 48  # above SsdDrafter's q_top_k (32): every sampled draft row is cut to its top 32
WIDE_CONFIG = tiny_config(vocab_size=WIDE_V, d_model=16)
WIDE_DRAFT_CONFIG = tiny_config(vocab_size=WIDE_V, d_model=16, n_layers=1)
WIDE_TARGET = Llama(WIDE_CONFIG, random_weights(WIDE_CONFIG, 11) | {"norm": 0.3 * torch.ones(16)}, torch.float32, "cpu")
# Flattened further than DRAFT, so the cut removes a good share of q's mass.
WIDE_DRAFT = Llama(WIDE_DRAFT_CONFIG, random_weights(WIDE_DRAFT_CONFIG, 12) | {"norm": 0.1 * torch.ones(16)},
                   torch.float32, "cpu")
CUT_ROWS = 30_000  # the twin: 1.14x the threshold at 10k rows, 1.86x at 30k


class CountsTheCut(SsdDrafter):
    """The real drafter, counting the draft rows it sampled and q's mass its top-q_top_k cut removed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled_rows, self.cut_rows, self.cut_mass = 0, 0, 0.0

    def _sample(self, logits, params):
        cut = 1 - torch.topk(logits_to_probs(logits, params), self.q_top_k, dim=-1).values.sum(-1)  # C = 1: q
        self.sampled_rows += len(cut)
        self.cut_rows += int((cut > 0.05).sum())
        self.cut_mass += float(cut.sum())
        return super()._sample(logits, params)


class ReportsAWiderCut(CountsTheCut):
    """Draws from q's top 24 but reports its top 32 (renormalised): a cut the verifier is not told of."""

    def _sample(self, logits, params):
        _, ids, probs = super()._sample(logits, params)
        narrow = probs * (torch.arange(probs.shape[-1]) < 24)  # top-k's ids come sorted, likeliest first
        picked = ids.gather(-1, torch.multinomial(narrow, 1, generator=self.generator)).squeeze(-1)
        return picked, ids, probs


def ssd_cut_check(name: str, drafter_cls: type[CountsTheCut]):
    """Token 3 alone (48 cells), T 1.0, C 1.0: -> (TV check, shares incl. the draft rows the cut removed
    more than 5% of q's mass from and the mean mass it removed)."""
    result, shares, drafters = ssd_check(name, SamplingParams(temperature=1.0), {"saguaro_c": 1.0}, drafter_cls,
                                         (WIDE_TARGET, WIDE_DRAFT), (2, 2), CUT_ROWS)
    sampled = sum(d.sampled_rows for d in drafters)
    shares |= {"rows cut 5%+": sum(d.cut_rows for d in drafters) / sampled,
               "mass cut": sum(d.cut_mass for d in drafters) / sampled}
    return result, shares


@pytest.mark.slow
def test_sampling_through_ssd_is_lossless_where_the_top_32_cut_truncates_q():
    result, shares = ssd_cut_check("SSD, V 48 > top-32 cut", CountsTheCut)
    report(result, **shares)
    assert shares["rows cut 5%+"] > 0.9 and shares["mass cut"] > 0.1, shares
    # The path this test names is the cut, which every draft SSD's model samples goes through (cached or a
    # miss's): about 0.23 of its rows are cache hits, under the bound, so the cache path is left to
    # test_sampling_through_ssd_is_lossless (0.30 and 0.63).
    assert_through_the_path(shares, result.n, path="drafted")
    assert shares["cache hit"] > 0 and shares["miss"] > 0.05, shares
    assert result.passed, result


@pytest.mark.slow
def test_the_harness_catches_a_cut_the_verifier_is_not_told_of():
    twin, shares = ssd_cut_check("SSD, V 48, drawn from the top 24, reported top 32", ReportsAWiderCut)
    report(twin, twin=True, **shares)
    assert_through_the_path(shares, twin.n, path="drafted")
    assert not twin.passed, f"biased twin slipped through: {twin}"
