"""A draft model of its own paired with a target (engine/runtime/draft_pair.py): taken when it shares the target's
tokenizer, in the same order or another (then mapped to the target's ids), refused at start otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.runtime.draft_pair import VocabularyMismatch, load_draft
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from tests.engine.runtime.gguf_families import byte_vocabulary, write_gguf
from tests.engine.runtime.test_families import NEW_TOKENS, PROMPTS, hf_model, one_thread  # noqa: F401

PERMUTATION = torch.randperm(256, generator=torch.Generator().manual_seed(5))  # draft id i <- target id PERM[i]


def _pair(tmp_path, name: str):
    """(the target's GGUF, the target, a one-layer draft of it as a GGUF in the target's token order)."""
    reference = hf_model(name)
    target_path = write_gguf(reference, tmp_path / "target.gguf")
    draft_hf = hf_model(name, num_hidden_layers=1)
    draft_hf.load_state_dict(reference.state_dict(), strict=False)
    return target_path, Llama.from_path(target_path, dtype="fp32", device="cpu")[0], draft_hf


def _permuted(draft_hf, path):
    """The same draft with its vocabulary in another order: token i of the file is the original's PERM[i]."""
    tokens, _ = byte_vocabulary(256)
    rows = {"token_embd.weight", "output.weight"}
    return write_gguf(draft_hf, path, tokens=[tokens[i] for i in PERMUTATION],
                      edit=lambda n, a: a[PERMUTATION.numpy()] if n in rows else a)


def _logits(model: Llama, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    return model.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]


@pytest.mark.parametrize("name", ["qwen2", "llama-tied"])  # an untied and a tied output
def test_a_draft_whose_vocabulary_is_a_permutation_is_mapped_to_the_targets_ids(name, tmp_path):
    target_path, target, draft_hf = _pair(tmp_path, name)
    same = load_draft(write_gguf(draft_hf, tmp_path / "draft.gguf"), target_path, 256, "fp32", "cpu")
    assert same.output_ids is None  # the same tokens in the same order: the file as it is
    mapped = load_draft(_permuted(draft_hf, tmp_path / "permuted.gguf"), target_path, 256, "fp32", "cpu")
    assert mapped.output_ids is not None
    torch.testing.assert_close(_logits(mapped, PROMPTS[0]), _logits(same, PROMPTS[0]))
    params = SamplingParams()
    ar = generate(target, PROMPTS, params, NEW_TOKENS, stop_ids=[])
    for draft in (same, mapped):
        spec = generate(target, PROMPTS, params, NEW_TOKENS, ModelDrafter(draft, 2, 256), num_draft_tokens=4,
                        stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert sum(r.accepted_tokens for r in spec) > 0


def test_a_draft_of_another_vocabulary_is_refused_naming_both(tmp_path):
    target_path, _, draft_hf = _pair(tmp_path, "qwen2")
    tokens, _ = byte_vocabulary(256)
    other = write_gguf(draft_hf, tmp_path / "other.gguf", tokens=tokens[:250] + [f"<x{i}>" for i in range(6)])
    with pytest.raises(VocabularyMismatch) as error:
        load_draft(other, target_path, 256, "fp32", "cpu")
    message = str(error.value)
    assert str(other) in message and str(target_path) in message and "256 tokens" in message
    assert "6 of the draft's tokens are not the target's: '<x0>'" in message


def test_a_padded_table_of_the_same_tokens_is_taken(tmp_path):
    """Qwen2.5's 0.5B pads its embedding to 151936 rows, its 7B to 152064: the same tokenizer."""
    target_path, _, _ = _pair(tmp_path, "qwen2")
    tokens, _ = byte_vocabulary(256)
    wider = hf_model("qwen2", num_hidden_layers=1, vocab_size=320)
    draft = load_draft(write_gguf(wider, tmp_path / "wide.gguf", tokens=tokens), target_path, 256, "fp32", "cpu")
    assert draft.config.vocab_size == 256 and len(draft.output_ids) == 256
    expected = Llama.from_path(tmp_path / "wide.gguf", dtype="fp32", device="cpu")[0]
    torch.testing.assert_close(_logits(draft, PROMPTS[1]), _logits(expected, PROMPTS[1])[:, :256])
    assert np.isfinite(_logits(draft, PROMPTS[1]).numpy()).all()


@pytest.mark.parametrize("name", ["qwen2", "llama-tied"])
@pytest.mark.parametrize("permuted", [False, True], ids=["same order", "permuted"])
def test_a_draft_head_cut_to_the_lowest_ids_scores_those_alone_and_stays_lossless(name, permuted, tmp_path):
    """The cut head's logits are the whole head's at the target ids it keeps (mapped ones too), it never
    drafts another token, and speculation with it still emits the target's AR tokens."""
    target_path, target, draft_hf = _pair(tmp_path, name)
    path = _permuted(draft_hf, tmp_path / "d.gguf") if permuted else write_gguf(draft_hf, tmp_path / "d.gguf")
    whole = load_draft(path, target_path, 256, "fp32", "cpu", head_tokens=None)
    cut = load_draft(path, target_path, 256, "fp32", "cpu", head_tokens=100)
    assert sorted(cut.output_ids.tolist()) == list(range(100))
    assert not cut.config.tie_embeddings
    full = _logits(whole, PROMPTS[0])
    torch.testing.assert_close(_logits(cut, PROMPTS[0])[:, :100], full[:, :100])
    assert torch.isinf(_logits(cut, PROMPTS[0])[:, 100:]).all()
    params = SamplingParams()
    ar = generate(target, PROMPTS, params, NEW_TOKENS, stop_ids=[])
    proposed = []

    class Recording(ModelDrafter):
        def propose(self, *args, **kwargs):
            drafts = super().propose(*args, **kwargs)
            proposed.extend(t for row in drafts.tokens for t in row)
            return drafts

    spec = generate(target, PROMPTS, params, NEW_TOKENS, Recording(cut, 2, 256), num_draft_tokens=4, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert proposed and max(proposed) < 100 and sum(r.accepted_tokens for r in spec) > 0


def test_a_quantized_head_is_cut_on_its_blocks():
    """A GGUF's tied head stays blocks (never dequantized whole): the cut one holds the kept rows' blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specpool.engine.runtime.config import tiny_config
    from specpool.engine.runtime.draft_pair import reduce_head
    from specpool.engine.runtime.gguf_loader import GGUFWeights, QuantizedBlocks

    config = tiny_config(vocab_size=256, d_model=64)
    embed = torch.randn(256, 64).numpy()
    blocks = {"embed": QuantizedBlocks(GGMLQuantizationType.Q8_0, (256, 64), quantize(embed, GGMLQuantizationType.Q8_0))}
    weights = GGUFWeights({"norm": torch.ones(64)}, blocks)
    config, weights, blocks = reduce_head(config, weights, blocks, 100)
    assert not config.tie_embeddings and weights.shape_of("lm_head") == (100, 64)
    assert torch.equal(blocks["lm_head"].dequantize(), blocks["embed"].dequantize()[:100])
    assert torch.equal(weights["output_ids"], torch.arange(100))
