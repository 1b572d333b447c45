"""The speculative loop end to end on tiny models: greedy equals AR; sampling is lossless.

The statistical tests run N sequences through `engine.decoding.generate` in one batch and compare
the joint distribution of generated tokens 2 and 3 (the first ones a drafter can speculate) with
the exact distribution enumerated from the target model.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import tiny_config
from engine.decoding import generate
from engine.drafter import Drafts, ModelDrafter
from engine.model import Llama
from engine.sampling import SamplingParams, logits_to_probs, make_generator
from tests.stats import tv, tv_threshold

V = 8
N = 100_000
PROMPT = [3, 1, 4, 1, 5]
TARGET = Llama.random_init(tiny_config(vocab_size=V, d_model=16), seed=11)
DRAFT = Llama.random_init(tiny_config(vocab_size=V, d_model=16, n_layers=1), seed=12)


class NextTokenDrafter:
    """A deterministic drafter: proposes (last + 1) mod V, repeatedly. q is a point mass."""

    def __init__(self):
        self.last: dict[str, int] = {}

    def add_sequence(self, seq_id, context):
        self.last[seq_id] = context[-1]

    def extend(self, seq_id, tokens):
        self.last[seq_id] = tokens[-1]

    def remove_sequence(self, seq_id):
        self.last.pop(seq_id, None)

    def propose(self, seq_ids, num_tokens, params, generator):
        rows = []
        for s, n in zip(seq_ids, num_tokens):
            rows.append([(self.last[s] + 1 + j) % V for j in range(n)])
        return Drafts(tokens=rows)


class MisreportingDrafter(ModelDrafter):
    """Samples from its q but reports a flattened q: the verifier then accepts with the wrong ratio."""

    def propose(self, seq_ids, num_tokens, params, generator):
        drafts = super().propose(seq_ids, num_tokens, params, generator)
        flat = drafts.probs.sqrt()
        return Drafts(tokens=drafts.tokens, probs=flat / flat.sum(-1, keepdim=True))


def exact_pair_distribution(params: SamplingParams) -> torch.Tensor:
    """p(t2, t3 | prompt), marginalising t1, by enumerating the target: [V*V], index t2*V + t3."""
    cache = TARGET.new_cache(V * V, 16)
    slots = [cache.allocate() for _ in range(V * V)]
    p1 = logits_to_probs(TARGET.forward(cache, [slots[0]], [PROMPT]), params)[0]  # [V]
    cache.release(slots[0])
    slots[0] = cache.allocate()
    rows = [PROMPT + [a, b] for a in range(V) for b in range(V)]
    logits = TARGET.forward(cache, slots, rows, all_logits=True)  # [V*V, T, V]
    p2 = logits_to_probs(logits[:, -2], params).view(V, V, V)[:, 0]  # [t1, t2]
    p3 = logits_to_probs(logits[:, -1], params).view(V, V, V)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).reshape(-1)


def run_pairs(params: SamplingParams, drafter, k: int, n: int = N) -> torch.Tensor:
    results = generate(
        TARGET, [PROMPT] * n, params, max_new_tokens=3, drafter=drafter, num_draft_tokens=k,
        stop_ids=[], generator=make_generator(params.seed),
    )
    return torch.tensor([r.token_ids[1] * V + r.token_ids[2] for r in results])


def check(params, drafter, k=3):
    pairs = run_pairs(params, drafter, k)
    exact = exact_pair_distribution(params)
    threshold, _ = tv_threshold(exact, pairs.numel(), make_generator(99))
    return tv(torch.bincount(pairs, minlength=V * V), exact), threshold


def test_target_and_draft_disagree_enough_to_matter():
    params = SamplingParams(temperature=3.0)  # random weights give peaked logits; flatten them
    cache_t, cache_d = TARGET.new_cache(1, 16), DRAFT.new_cache(1, 16)
    p = logits_to_probs(TARGET.forward(cache_t, [cache_t.allocate()], [PROMPT]), params)[0]
    q = logits_to_probs(DRAFT.forward(cache_d, [cache_d.allocate()], [PROMPT]), params)[0]
    assert 0.15 < 0.5 * (p - q).abs().sum() < 0.9
    assert p.max() < 0.8  # not near-greedy, so sampling bias would show


def test_greedy_speculation_equals_ar(tiny_model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
    params = SamplingParams()
    ar = generate(tiny_model, prompts, params, max_new_tokens=24, stop_ids=[])
    for k in (1, 4):
        spec = generate(tiny_model, prompts, params, 24, ModelDrafter(draft, 4, 64), num_draft_tokens=k, stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert all(r.target_steps < len(r.token_ids) - 1 for r in spec) or k == 1
    # The target's own model as drafter accepts everything: K+1 tokens per step.
    self_spec = generate(tiny_model, prompts, params, 24, ModelDrafter(tiny_model, 4, 64), 4, stop_ids=[])
    assert [r.token_ids for r in self_spec] == [r.token_ids for r in ar]
    assert all(r.mean_accept_len > 4 for r in self_spec)


def test_stops_at_stop_token_and_length(tiny_model):
    params = SamplingParams()
    [free] = generate(tiny_model, [[5, 6, 7]], params, max_new_tokens=12, stop_ids=[])
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    [stopped] = generate(tiny_model, [[5, 6, 7]], params, 12, ModelDrafter(tiny_model, 1, 64), 3, [stop_tok])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"
    assert len(free.token_ids) == 12


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, params, make_drafter",
    [
        ("dense q", SamplingParams(temperature=3.0, seed=1), lambda: ModelDrafter(DRAFT, N, 16)),
        ("sparse top-k q", SamplingParams(temperature=3.0, top_k=4, seed=2), lambda: ModelDrafter(DRAFT, N, 16)),
        ("point mass", SamplingParams(temperature=2.5, top_p=0.9, seed=3), NextTokenDrafter),
        ("no drafter", SamplingParams(temperature=3.0, seed=4), lambda: None),
    ],
)
def test_speculative_sampling_is_lossless(name, params, make_drafter):
    distance, threshold = check(params, make_drafter())
    assert distance < threshold, f"{name}: TV {distance:.4f} >= {threshold:.4f}"


@pytest.mark.slow
def test_loop_level_check_catches_a_misreported_q():
    params = SamplingParams(temperature=3.0, seed=5)
    distance, threshold = check(params, MisreportingDrafter(DRAFT, N, 16))
    assert distance > threshold, f"biased drafter passed: TV {distance:.4f} < {threshold:.4f}"
