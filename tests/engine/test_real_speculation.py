"""Speculation with the real target and the committed draft/datastore: greedy output equals AR."""

from pathlib import Path

import pytest

from specpool.bench.workloads import load_workload
from specpool.engine.decoding import generate
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.runtime.chunked_models import ModelNotAssembled, model_path
from specpool.engine.runtime.draft_pair import load_draft
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


@pytest.fixture(scope="module")
def qwen_coder_1_5b():
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M in the default format (auto: q4 on its K-quant blocks), where
    `make setup` has assembled it."""
    return Llama.from_gguf(_assembled("qwen2.5-coder-1.5b"), dtype="auto", device="cpu")


@pytest.fixture(scope="module")
def qwen_coder_0_5b_draft(qwen_coder_1_5b):
    """Qwen2.5-Coder-0.5B-Instruct as the 1.5B's draft model, loaded as serve-spec's `--drafter
    TARGET,draft=GGUF` loads it (spec_endpoint/drafters.py: the same vocabulary, the default format)."""
    model, _ = qwen_coder_1_5b
    return load_draft(_assembled("qwen2.5-coder-0.5b"), _assembled("qwen2.5-coder-1.5b"), model.config.vocab_size,
                      "auto", "cpu")


def _assembled(name: str) -> str:
    try:
        return model_path(name)
    except ModelNotAssembled as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("draft_len", [2, 8])
def test_qwen_coder_ngram_speculation_equals_ar(qwen_coder_1_5b, draft_len):
    """Issue 50: the K-quant file's fused layers (Qwen2 biases, mixed Q4_K/Q6_K stacks) verify K drafts
    with the same greedy tokens as one-token decode steps, on the real 1.5B."""
    model, tokenizer = qwen_coder_1_5b
    prompt = tokenizer.encode_chat([{"role": "user", "content": (
        "Add type hints to this function and return it:\n```python\ndef add(a, b):\n    return a + b\n```")}])
    [ar] = generate(model, [prompt], SamplingParams(), 32)
    [spec] = generate(model, [prompt], SamplingParams(), 32, NgramDrafter(), draft_len)
    assert spec.token_ids == ar.token_ids
    print(f"n-gram K={draft_len}: {len(spec.token_ids)} tokens in {spec.target_steps} target steps")


@pytest.mark.parametrize("workload", ["humaneval", "chat"])
def test_qwen_coder_draft_model_speculation_equals_ar(qwen_coder_1_5b, qwen_coder_0_5b_draft, workload):
    """Issue 50: the real 0.5B drafting for the real 1.5B (both in the default format) gives the 1.5B's own
    greedy tokens, on the first HumanEval prompt (raw text) and the first chat prompt (the chat template)."""
    model, tokenizer = qwen_coder_1_5b
    [prompt] = load_workload(workload, tokenizer, limit=1)
    new_tokens, draft_len = 64, 4
    [ar] = generate(model, [prompt], SamplingParams(), new_tokens)
    drafter = ModelDrafter(qwen_coder_0_5b_draft, 1, len(prompt) + new_tokens + draft_len + 1)
    [spec] = generate(model, [prompt], SamplingParams(), new_tokens, drafter, draft_len)
    assert spec.token_ids == ar.token_ids
    # The draft model's path ran: it proposed, the target took some, in fewer forwards than tokens.
    assert spec.drafted_tokens > 0 and spec.accepted_tokens > 0
    assert spec.target_steps < len(spec.token_ids)
    print(f"0.5B draft, K={draft_len}, {workload}: {len(spec.token_ids)} tokens in {spec.target_steps} target steps "
          f"({spec.mean_accept_len:.2f} per step), {spec.accepted_tokens}/{spec.drafted_tokens} drafts accepted")
