"""The trainable head computes what the runtime computes, step by unrolled step, in every family the
engine runs, and its export loads."""

from dataclasses import replace

import pytest
import torch

from specpool.engine.runtime.config import RopeScaling, tiny_config
from specpool.engine.runtime.model import Llama, random_weights
from specpool.training.head import FeatureWindows, HeadLM, export, head_losses
from specpool.training.head_data import FeatureCorpus
from tests.training.test_distill import _tiny_target_weights

OUTPUT_IDS = torch.tensor([2, 5, 7, 11, 13, 17, 19, 23, 29, 31, 40, 63])
# The tiny target of each family, its feature sized to matter within the tests' 8 positions.
FAMILIES = {
    "llama": {},
    "llama3": {"tie_embeddings": False, "rope_scaling": RopeScaling(8.0, 1.0, 4.0, original_context=4)},
    "mistral": {"sliding_window": 3},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True, "head_dim": 16},  # 4 heads x 16 != d_model 32
}


def _head_and_runtime(tmp_path, family: str = "llama"):
    if family == "llama":
        config, weights = _tiny_target_weights()
    else:
        config = replace(tiny_config(vocab_size=64, n_layers=3), **FAMILIES[family])
        weights = random_weights(config, seed=0)
    head = HeadLM.from_target(config, weights, OUTPUT_IDS)
    with torch.no_grad():  # a trained head's norms are not ones: make the test see them
        head.embed_norm.mul_(1.3)
        head.feature_norm.add_(0.2)
    export(head, tmp_path, "tiny.gguf", dtype=torch.float32)
    return head, Llama.from_draft_checkpoint(tmp_path, weights["embed"], dtype="fp32", device="cpu")


def test_the_head_starts_from_the_targets_output_rows():
    """An untied target (Llama 3.1 8B) scores with its own lm_head, not its input embeddings."""
    config = replace(tiny_config(vocab_size=64, n_layers=3), tie_embeddings=False)
    weights = random_weights(config, seed=0)
    head = HeadLM.from_target(config, weights, OUTPUT_IDS)
    torch.testing.assert_close(head.lm_head.detach(), weights["lm_head"][OUTPUT_IDS])
    torch.testing.assert_close(head.teacher_head, weights["lm_head"][OUTPUT_IDS])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_step_matches_the_runtime(tmp_path, family):
    head, runtime = _head_and_runtime(tmp_path, family)
    tokens = torch.tensor([[3, 9, 27, 17, 51, 4, 8]])
    feats = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(3)) * 2
    with torch.no_grad():
        reduced = head.logits(head.unrolled(tokens, feats, 1)[0])[0]  # [P, Vd]
    cache = runtime.new_cache(1, 16)
    full = runtime.forward(cache, [cache.allocate()], tokens.tolist(), all_logits=True, fed_features=feats)[0]
    torch.testing.assert_close(full[:, OUTPUT_IDS], reduced, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_later_steps_are_what_drafting_from_an_anchor_computes(tmp_path, family):
    """Unrolled step j at position p equals the runtime fed the true pairs up to the anchor p - j, then
    its own predicted features: the training mask is the drafting loop's (a sliding window's too)."""
    head, runtime = _head_and_runtime(tmp_path, family)
    tokens = torch.tensor([[3, 9, 27, 17, 51, 4, 8, 12]])
    feats = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(4)) * 2
    with torch.no_grad():
        steps = head.unrolled(tokens, feats, 3)
    p = 6
    for j in (1, 2):
        anchor = p - j
        cache = runtime.new_cache(1, 16)
        slot = cache.allocate()
        _, hidden = runtime.forward(cache, [slot], [tokens[0, : anchor + 1].tolist()], features=True,
                                    fed_features=feats[:, : anchor + 1])
        for s in range(1, j + 1):
            _, hidden = runtime.forward(cache, [slot], [[int(tokens[0, anchor + s])]], features=True,
                                        fed_features=hidden[:, -1:])
        torch.testing.assert_close(hidden[0, -1], steps[j][0, p], atol=1e-4, rtol=1e-4)


def test_training_lowers_the_loss_at_every_step():
    config, weights = _tiny_target_weights()
    head = HeadLM.from_target(config, weights, torch.arange(64))
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 64, (20,), generator=gen).tolist() for _ in range(6)]
    corpus = FeatureCorpus(sequences, [4] * 6, [torch.randn(20, 32, generator=gen) for _ in sequences])
    batch = FeatureWindows(corpus, window=16, seed=0).take([(i, 0) for i in range(6)])
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss, _ = head_losses(head, *batch, steps=3)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
