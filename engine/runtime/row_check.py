"""The start-up check that a loaded model's format is lossless against its own AR on this machine: a
token's logits are the same bits whichever step computes them (a decode row, a verify row, a token tree's
path, a row of a large batch).

Speculation equals AR only if they are: a verify step that rounds a row differently from the decode step
would part greedy output at near-ties and bias sampled output. Whether a format's kernels work row by row
is a property of this CPU's code paths, not of the format. On an Intel Xeon VM with AMX, oneDNN's bf16
matmul (the dense LM head beside torch's int4 kernel) runs more than 32 rows through other AMX blocking
than one row, and its logits differed by 0.03-0.125 (issue 53); on an AMD EPYC the same code agreed. So
every model is checked as loaded, on this machine, on its first layers and its head, and a format whose
rows differ is replaced by the next one (engine/runtime/device.py `WeightFormat.fallback`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

CHECK_LAYERS = 2  # the first layers and the head: every kind of matrix and attention the format runs
PROMPT, DRAFTS = 12, 8  # a verify step of K = 8 after a 12-token prompt
# A batch's verify step: 8 x 9 = 72 rows, past the row counts where kernels switch their blocking (oneDNN's bf16
# at 32; the engine's own row tiles of 16, AMX's from 6 or 12 rows). 16 x 9 rows took a 151,936-token head's
# logits, 87 MB, to the top of a 1.5B file's load.
BATCH = 8


def row_mismatch(model) -> str | None:
    """None where decode, verify, tree and batch rows of `model` give the same bits; else which differed."""
    probe = copy.copy(model)
    probe.config = dataclasses.replace(model.config, n_layers=min(CHECK_LAYERS, model.config.n_layers))
    probe.layers = model.layers[: probe.config.n_layers]
    vocab, context = model.config.vocab_size, model.config.max_context
    n_drafts = min(DRAFTS, context // 2 - 1)  # a model of a short context checks a shorter sequence
    n_prompt = min(PROMPT, context - n_drafts - 1)
    prompt = [(17 + 31 * i) % vocab for i in range(n_prompt)]
    drafts = [(5 + 13 * i) % vocab for i in range(n_drafts + 1)]

    features = _features(probe, n_prompt + n_drafts + 1)

    def prefilled(batch: int):
        cache = probe.new_cache(batch, n_prompt + n_drafts + 1)
        slots = [cache.allocate() for _ in range(batch)]
        probe.forward(cache, slots, [prompt] * batch, prefill=True, **_fed(features, 0, n_prompt, batch))
        return cache, slots

    cache, [slot] = prefilled(1)
    decoded = torch.stack([probe.forward(cache, [slot], [[t]], **_fed(features, n_prompt + i, 1))[0]
                           for i, t in enumerate(drafts)])
    cache, [slot] = prefilled(1)
    verified = probe.forward(cache, [slot], [drafts], all_logits=True, **_fed(features, n_prompt, len(drafts)))[0]
    if not torch.equal(verified, decoded):
        return f"a verify step's {len(drafts)} rows differ from decode steps' by up to {_gap(verified, decoded)}"
    cache, slots = prefilled(BATCH)
    batched = probe.forward(cache, slots, [drafts] * BATCH, all_logits=True,
                            **_fed(features, n_prompt, len(drafts), BATCH))
    if not all(torch.equal(rows, decoded) for rows in batched):
        return (f"a batch of {BATCH} verify rows each ({BATCH * len(drafts)} rows) differs from decode steps by up "
                f"to {max(_gap(rows, decoded) for rows in batched)}")
    if not model.config.feature_fed:  # a tree: the path's nodes beside a sibling of the first
        cache, [slot] = prefilled(1)
        sibling = (drafts[0] + 1) % vocab
        tree = probe.forward(cache, [slot], [[drafts[0], sibling, drafts[1], drafts[2]]], all_logits=True,
                             parents=[[-1, -1, 0, 2]])[0]
        if not torch.equal(tree[[0, 2, 3]], decoded[:3]):
            return f"a token tree's path differs from decode steps by up to {_gap(tree[[0, 2, 3]], decoded[:3])}"
    return None


def _features(model, length: int) -> torch.Tensor | None:
    """A feature-fed model's inputs beside its tokens: fixed values, the same for every step kind."""
    if not model.config.feature_fed:
        return None
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, length, model.config.d_model, generator=generator).to(model.device, model.dtype)


def _fed(features: torch.Tensor | None, start: int, count: int, batch: int = 1) -> dict:
    if features is None:
        return {}
    return {"fed_features": features[:, start : start + count].expand(batch, -1, -1)}


def _gap(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a.double() - b.double()).abs().max().item():.3g}"
