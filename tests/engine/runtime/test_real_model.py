"""The default target (SmolLM2-135M-Instruct GGUF) against transformers reading the same file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from specpool.engine.decoding import generate
from specpool.engine.verification.sampling import SamplingParams

pytestmark = pytest.mark.slow

FACTORIAL = "Write a Python function that returns the factorial of n."
NEAR_TIE = 1e-4  # top-2 logit gap below which fp rounding may legitimately flip the argmax


def _full_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    return model.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]  # [T, V]


def _top2_gap(model, context: list[int]) -> float:
    top = _full_logits(model, context)[-1].topk(2).values
    return float(top[0] - top[1])


def test_logits_match_transformers(real_model, hf_model):
    model, tokenizer = real_model
    text = Path(__file__).read_text()[:3000]  # a few hundred tokens of ordinary text and code
    tokens = [model.config.bos_id] + tokenizer.encode(text)[:299]
    assert len(tokens) == 300
    ours = _full_logits(model, tokens)
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"max |logit diff| over {len(tokens)} tokens: {diff:.2e}")
    assert diff < 1e-3


def test_tokenizer_and_chat_template_match_transformers(real_model):
    from specpool.engine.runtime.gguf_loader import default_model_path

    _, tokenizer = real_model
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": FACTORIAL}]
    assert tokenizer.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    for text in ["Hello world! 12345  x\n\n\tdef f(x):\n    return x**2  # é 中文 🙂", "It's 3.14159, isn't it?"]:
        assert tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_cli_generate_matches_transformers_greedy(hf_model):
    out = subprocess.run(
        [sys.executable, "-m", "specpool.cli", "generate", "--chat", "--prompt", FACTORIAL,
         "--max-tokens", "48", "--temperature", "0", "--json", "--dtype", "fp32"],  # the reference format
        capture_output=True, text=True, check=True, timeout=600,
    )
    result = json.loads(out.stdout)
    assert set(result) == {"text", "prompt_token_ids", "token_ids", "tokens_per_s"}
    assert "def factorial" in result["text"] and "return" in result["text"]
    assert result["tokens_per_s"] > 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([result["prompt_token_ids"]]), max_new_tokens=48, do_sample=False, num_beams=1
        )[0, len(result["prompt_token_ids"]) :].tolist()
    assert result["token_ids"] == ref


def test_batch_of_8_ragged_prompts_equals_each_alone(real_model):
    model, tokenizer = real_model
    questions = [
        "Hi.",
        "What is 2 + 2? Answer briefly.",
        "Name three primary colors.",
        "Write a haiku about the sea.",
        "Explain what a hash map is in one sentence.",
        "List the planets of the solar system in order from the sun.",
        "Write a Python function that reverses a string, and explain how it works step by step.",
        "Summarise the plot of Romeo and Juliet in two sentences, then give one lesson it teaches.",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == 8
    params = SamplingParams()
    batched = generate(model, prompts, params, max_new_tokens=32)
    near_ties, mismatches = 0, []
    for prompt, together in zip(prompts, batched):
        [alone] = generate(model, [prompt], params, max_new_tokens=32)
        if together.token_ids == alone.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(together.token_ids, alone.token_ids)) if a != b)
        gap = _top2_gap(model, prompt + alone.token_ids[:i])
        if gap < NEAR_TIE:
            near_ties += 1
        else:
            mismatches.append((prompt, i, gap))
    print(f"batch-8 vs alone: {8 - near_ties - len(mismatches)} equal, {near_ties} near-ties (gap < {NEAR_TIE})")
    assert not mismatches
