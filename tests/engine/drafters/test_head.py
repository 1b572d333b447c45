"""The feature-fed head drafter: lossless under greedy, and its per-round bookkeeping (true pairs in,
drafts' K/V out) leaves it where a fresh head fed the same history would be."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams
from specpool.training.head import FeatureWindows, HeadLM, export, head_losses
from specpool.training.head_data import FeatureCorpus


def tiny_head(seed: int = 7, vocab_size: int = 64) -> Llama:
    config = dataclasses.replace(tiny_config(vocab_size=vocab_size, n_layers=1), feature_fed=True)
    return Llama.random_init(config, seed=seed)


def _features(model: Llama, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    return model.forward(cache, [cache.allocate()], [tokens], features=True)[1][0]  # [T, d]


def test_greedy_head_drafting_equals_ar(tiny_model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=24, stop_ids=[])
    for k in (1, 4):
        spec = generate(tiny_model, prompts, SamplingParams(), 24, HeadDrafter(tiny_head(), 4, 64), k, stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert all(r.drafted_tokens > 0 for r in spec)


def test_after_a_round_the_head_drafts_as_a_fresh_head_fed_the_same_history(tiny_model):
    head = tiny_head()
    prompt = [5, 9, 14, 3, 22]
    first = int(tiny_model.forward(*_slot(tiny_model), [prompt]).argmax())
    drafter = HeadDrafter(head, 1, 64)
    drafter.start("s", prompt + [first], features=_features(tiny_model, prompt))
    [drafts] = drafter.propose(["s"], [3], SamplingParams(), None).tokens
    emitted = [drafts[0], (drafts[1] + 1) % 64]  # one draft accepted, then a token of the target's
    history = prompt + [first] + emitted
    features = _features(tiny_model, history[:-1])
    drafter.observe("s", emitted, features=features[len(prompt) : len(prompt) + 2])
    [again] = drafter.propose(["s"], [3], SamplingParams(), None).tokens

    fresh = HeadDrafter(head, 1, 64)
    fresh.start("s", history, features=features)
    assert fresh.propose(["s"], [3], SamplingParams(), None).tokens == [again]


def test_a_head_needs_its_features(tiny_model):
    drafter = HeadDrafter(tiny_head(), 1, 64)
    with pytest.raises(ValueError, match="features"):
        drafter.start("s", [1, 2, 3])
    with pytest.raises(ValueError, match="feature-fed"):
        HeadDrafter(tiny_model, 1, 64)


def _slot(model: Llama):
    cache = model.new_cache(1, 64)
    return cache, [cache.allocate()]


@functools.cache
def trained_tiny_head(target: Llama, steps: int = 100, greedy_paths: bool = True) -> Llama:
    """A head trained on a tiny target's own samples and features (training/head.py, in seconds): its
    drafts agree with the target often enough to reach deep tree paths, as a real head's do. Without
    `greedy_paths` it learns the sampled distribution alone, spread enough for sampled trees' second
    siblings to be accepted; with them it also drafts every greedy path (the greedy tests)."""
    weights = random_weights(target.config, seed=11)
    assert torch.equal(weights["embed"], target.embed), "the tiny target must be random_init(seed=11)"
    with tempfile.TemporaryDirectory() as out:
        export(train_tiny_head(target, weights, steps, greedy_paths), Path(out), "tiny.gguf", dtype=torch.float32)
        return Llama.from_draft_checkpoint(out, weights["embed"], dtype="fp32", device="cpu")


def train_tiny_head(target: Llama, weights: dict[str, torch.Tensor], steps: int = 100,
                    greedy_paths: bool = True) -> HeadLM:
    """A head for a tiny target (its weights), trained on the target's own samples and (with
    `greedy_paths`) on its greedy path from every token, with their features: a random tiny target's
    greedy paths fall into a few repeated tokens, which the greedy tests draft, so the head learns each
    of them whatever the sampler drew."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (4,), generator=gen).tolist() for _ in range(48)]
    samples = generate(target, prompts, SamplingParams(temperature=1.0, seed=1), 28, stop_ids=[])
    starts = [[t] for t in range(target.config.vocab_size)] if greedy_paths else []
    greedy = generate(target, starts, SamplingParams(), 31, stop_ids=[]) if starts else []
    sequences = [p + r.token_ids for p, r in zip(prompts + starts, samples + greedy)]
    cache = target.new_cache(len(sequences), 32)
    _, features = target.forward(cache, [cache.allocate() for _ in sequences], sequences, features=True)
    corpus = FeatureCorpus(sequences, [len(p) for p in prompts + starts], list(features))
    head = HeadLM.from_target(target.config, weights, torch.arange(target.config.vocab_size))
    windows = FeatureWindows(corpus, window=32, seed=0)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = head_losses(head, *windows.sample(8), steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head
