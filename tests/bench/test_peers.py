"""bench/peers.py: the transformers baselines decode what our engine decodes, and the HF copy of a
distilled draft computes what our runtime draft computes."""

from __future__ import annotations

import pytest
import torch
import transformers

from specpool.bench.peers import gguf_to_hf_rope_layout, hf_assisted, hf_generate, hf_prompt_lookup

QUESTIONS = [
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France?",
]
NEW_TOKENS = 24


def test_rope_layout_conversion_matches_adjacent_pair_rope():
    """RoPE on adjacent pairs of W x equals HF's rotate-half RoPE on W' x, up to the same row order."""
    rotate_half = transformers.models.llama.modeling_llama.rotate_half  # loads the modeling code here

    gen = torch.Generator().manual_seed(0)
    H, D, d = 3, 8, 5
    w, x = torch.randn(H * D, d, generator=gen), torch.randn(d, generator=gen)
    angles = 0.7 * (1.0 / 100.0 ** (torch.arange(D // 2) * 2 / D))  # position 0.7, base 100

    pairs = (w @ x).view(H, D // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    ours = torch.stack((x0 * angles.cos() - x1 * angles.sin(), x0 * angles.sin() + x1 * angles.cos()), -1)

    q = (gguf_to_hf_rope_layout(w, H) @ x).view(H, D)
    cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
    theirs = q * cos + rotate_half(q) * sin
    expected = gguf_to_hf_rope_layout(ours.reshape(H * D, 1), H).view(H, D)
    torch.testing.assert_close(theirs, expected)


# -- real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a loaded 2-core box, 2 threads made these decodes ~7x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    """(gguf weights, our fp32 runtime, tokenizer, chat prompts): one GGUF read serves all three."""
    from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
    from specpool.engine.runtime.model import Llama
    from specpool.engine.runtime.tokenizer import Tokenizer

    gguf = load_gguf(default_model_path())
    model = Llama(gguf.config, gguf.weights, torch.float32, "cpu")
    tokenizer = Tokenizer.from_gguf(gguf)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return gguf, model, tokenizer, prompts


@pytest.fixture(scope="module")
def hf_target():
    from specpool.bench.peers import load_hf_target
    from specpool.engine.runtime.gguf_loader import default_model_path

    return load_hf_target(default_model_path())


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """A 2-layer draft cut from the target (layers 0 and 1) over a reduced vocabulary, exported
    exactly as `specpool train-draft` exports one."""
    from specpool.training.distill import DraftLM, export

    gguf, _, _, prompts = target
    output_ids = torch.unique(torch.cat([torch.arange(0, 3000), *map(torch.tensor, prompts)]))
    draft = DraftLM.from_target(gguf.config, gguf.weights, [0, 1], output_ids)
    out = tmp_path_factory.mktemp("draft")
    export(draft, out, "target.gguf", dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def hf_draft(draft_dir):
    from specpool.bench.peers import load_hf_draft
    from specpool.engine.runtime.gguf_loader import default_model_path

    return load_hf_draft(draft_dir, default_model_path())


@pytest.fixture(scope="module")
def hf_greedy(hf_target, target):
    """transformers' greedy AR output at batch 1 for every prompt."""
    return hf_generate(hf_target, target[3], NEW_TOKENS, batch_size=1)


@pytest.mark.slow
def test_hf_draft_logits_match_runtime_draft(target, draft_dir, hf_draft):
    from specpool.engine.runtime.model import Llama

    gguf, _, _, prompts = target
    ours = Llama.from_draft_checkpoint(draft_dir, gguf.weights["embed"], dtype="fp32", device="cpu")
    tokens = prompts[0][:30]
    cache = ours.new_cache(1, len(tokens))
    expected = ours.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]  # [T, V]
    with torch.no_grad():
        got = hf_draft(torch.tensor([tokens])).logits[0].float()
    assert got.shape == expected.shape == (30, gguf.config.vocab_size)
    inside = torch.zeros(gguf.config.vocab_size, dtype=torch.bool)
    inside[ours.output_ids] = True
    diff = (got[:, inside] - expected[:, inside]).abs().max().item()
    print(f"max |logit diff| HF draft vs runtime draft: {diff:.2e}")
    assert diff < 1e-3
    assert (got[:, ~inside] < -1e30).all()


@pytest.mark.slow
def test_hf_generate_greedy_matches_engine_and_batching(target, hf_target, hf_greedy):
    from specpool.engine.decoding import generate
    from specpool.engine.verification.sampling import SamplingParams

    _, model, _, prompts = target
    ours = [generate(model, [p], SamplingParams(), NEW_TOKENS)[0].token_ids for p in prompts]
    assert hf_greedy.token_ids == ours
    assert hf_greedy.new_tokens == sum(len(t) for t in ours) and hf_greedy.seconds > 0

    batched = hf_generate(hf_target, prompts, NEW_TOKENS, batch_size=2)  # left-padded, ragged lengths
    assert batched.token_ids == hf_greedy.token_ids


@pytest.mark.slow
def test_prompt_lookup_and_assisted_are_lossless_at_temperature_0(target, hf_target, hf_draft, hf_greedy):
    prompt, expected = target[3][0], hf_greedy.token_ids[0]
    lookup = hf_prompt_lookup(hf_target, [prompt], NEW_TOKENS)
    assert lookup.token_ids == [expected]
    assisted = hf_assisted(hf_target, hf_draft, [prompt], NEW_TOKENS, num_assistant_tokens=4)
    assert assisted.token_ids == [expected]
    assert hf_draft.generation_config.num_assistant_tokens == 4


@pytest.mark.slow
def test_transformers_refuses_batched_prompt_lookup(target, hf_target):
    """Why hf_prompt_lookup / hf_assisted decode one prompt at a time (transformers 5.x)."""
    prompts = target[3]
    ids = torch.tensor([prompts[0][-8:], prompts[1][-8:]])
    with pytest.raises(ValueError, match="batch_size = 1"):
        hf_target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
            prompt_lookup_num_tokens=3, pad_token_id=2,
        )
