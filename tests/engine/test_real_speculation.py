"""Speculation with the real target and the committed draft/datastore: greedy output equals AR."""

from pathlib import Path

import pytest

from specpool.engine.decoding import generate
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

pytestmark = pytest.mark.slow

MODELS = Path(__file__).resolve().parents[2] / "models"
QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
]


@pytest.fixture(scope="module")
def prompts(real_model):
    _, tokenizer = real_model
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def ar_outputs(real_model, prompts):
    model, _ = real_model
    return [r.token_ids for r in generate(model, prompts, SamplingParams(), 48)]


def test_draft_model_speculation_equals_ar(real_model, prompts, ar_outputs):
    model, _ = real_model
    draft = Llama.from_draft_checkpoint(MODELS / "smollm2-135m-draft", model.embed, dtype="bf16", device="cpu")
    results = generate(model, prompts, SamplingParams(), 48, ModelDrafter(draft, len(prompts), 512), 4)
    assert [r.token_ids for r in results] == ar_outputs
    accept = sum(len(r.token_ids) - 1 for r in results) / sum(r.target_steps for r in results)
    print(f"draft model, K=4: {accept:.2f} tokens per target step")
    assert accept > 1.5  # a trained draft, not a random one


def test_ngram_speculation_equals_ar(real_model, prompts, ar_outputs):
    model, _ = real_model
    store = SuffixArrayDatastore.load(MODELS / "smollm2-135m-datastore.npz")
    results = generate(model, prompts, SamplingParams(), 48, NgramDrafter(store), 8)
    assert [r.token_ids for r in results] == ar_outputs
