"""SSD in-process: the speculation cache is hit, greedy output equals AR, sampling stays lossless.

`Inline` runs SSD sequentially (pre-speculation right after drafts are handed out, before the
target verifies them), which exercises exactly the endpoint's cache, forks and backups.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import tiny_config
from engine.decoding import generate
from engine.model import Llama, random_weights
from engine.sampling import SamplingParams, logits_to_probs, make_generator
from engine.ssd import SsdDrafter, geometric_fanout
from tests.stats import tv, tv_threshold


class Inline:
    """The Drafter protocol over an SsdDrafter, pre-speculating after every propose."""

    def __init__(self, ssd: SsdDrafter):
        self.ssd = ssd

    def add_sequence(self, seq_id, context):
        self.ssd.add_sequence(seq_id, context)

    def extend(self, seq_id, tokens):
        self.ssd.extend(seq_id, tokens)

    def remove_sequence(self, seq_id):
        self.ssd.remove_sequence(seq_id)

    def propose(self, seq_ids, num_tokens, params, generator):
        drafts = self.ssd.propose(seq_ids, num_tokens, params, generator)
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
        def add_sequence(self, seq_id, tokens):
            context[seq_id] = list(tokens)
            super().add_sequence(seq_id, tokens)

        def extend(self, seq_id, tokens):
            context[seq_id] += list(tokens)
            super().extend(seq_id, tokens)

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


# -- lossless sampling ---------------------------------------------------------------------------------

V = 8
N = 100_000
CHUNK = 10_000
PROMPT = [3, 1, 4, 1, 5]
TARGET = Llama.random_init(tiny_config(vocab_size=V, d_model=16), seed=11)
DRAFT_CONFIG = tiny_config(vocab_size=V, d_model=16, n_layers=1)
# A flat draft (final norm scaled down): a random tiny model is nearly one-hot otherwise, and
# Saguaro's rescaling of its top tokens would change too little to show in a test.
DRAFT = Llama(DRAFT_CONFIG, random_weights(DRAFT_CONFIG, 12) | {"norm": 0.15 * torch.ones(16)}, torch.float32, "cpu")


def exact_late_pair(params: SamplingParams) -> torch.Tensor:
    """p(t3, t4 | prompt), marginalising t1, t2: [V*V], index t3*V + t4 (drafted from the cache)."""
    rows = torch.cartesian_prod(*[torch.arange(V)] * 4)  # [V^4, 4]: t1..t4
    cache = TARGET.new_cache(len(rows) + 1, 16)
    first = cache.allocate()
    p1 = logits_to_probs(TARGET.forward(cache, [first], [PROMPT]), params)[0]
    slots = [cache.allocate() for _ in range(len(rows))]
    logits = TARGET.forward(cache, slots, [PROMPT + r.tolist() for r in rows], all_logits=True)
    p = logits_to_probs(logits[:, -4:-1], params)  # [V^4, 3, V]: p(t2|t1), p(t3|t1,t2), p(t4|..t3)
    idx = torch.arange(len(rows))
    prob = p1[rows[:, 0]] * p[idx, 0, rows[:, 1]] * p[idx, 1, rows[:, 2]] * p[idx, 2, rows[:, 3]]
    return torch.zeros(V * V).index_add_(0, rows[:, 2] * V + rows[:, 3], prob)


def run_late_pairs(params: SamplingParams, ssd_kwargs: dict, drafter_cls=SsdDrafter) -> torch.Tensor:
    gen = make_generator(1)
    pairs = []
    for _ in range(N // CHUNK):
        ssd = drafter_cls(DRAFT, CHUNK, 16, fork_slots=4 * CHUNK, fork_budget=4, **ssd_kwargs)
        ssd.generator.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        results = generate(TARGET, [PROMPT] * CHUNK, params, 5, Inline(ssd), 2, stop_ids=[], generator=gen)
        pairs += [r.token_ids[2] * V + r.token_ids[3] for r in results]
        assert ssd.stats.hits > 0
    return torch.tensor(pairs)


def check(params: SamplingParams, ssd_kwargs: dict, drafter_cls=SsdDrafter) -> tuple[float, float]:
    exact = exact_late_pair(params)
    counts = torch.bincount(run_late_pairs(params, ssd_kwargs, drafter_cls), minlength=V * V)
    threshold, _ = tv_threshold(exact, N, torch.Generator().manual_seed(0))
    return tv(counts, exact), threshold


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("saguaro_c", [1.0, 0.3])
def test_sampling_through_ssd_is_lossless(temperature, saguaro_c):
    distance, threshold = check(SamplingParams(temperature=temperature), {"saguaro_c": saguaro_c})
    print(f"T={temperature} C={saguaro_c}: TV {distance:.4f} (threshold {threshold:.4f})")
    assert distance < threshold


class UnrescaledQ(SsdDrafter):
    """Samples with Saguaro's rescaling but reports q as if it had not: the classic biased verifier input."""

    def _sample(self, logits, params):
        picked, _, _ = super()._sample(logits, params)
        top = torch.topk(logits_to_probs(logits, params), min(self.q_top_k, logits.shape[-1]), dim=-1)
        return picked, top.indices, top.values / top.values.sum(-1, keepdim=True)


@pytest.mark.slow
def test_the_harness_catches_a_misreported_saguaro_q():
    distance, threshold = check(SamplingParams(temperature=1.0), {"saguaro_c": 0.1}, UnrescaledQ)
    assert distance > threshold
