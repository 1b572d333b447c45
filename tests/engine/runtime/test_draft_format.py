"""Draft checkpoints (the draft model, the head) load on Q8_0 blocks of their matrices by default where the
engine's kernels build (engine/runtime/device.py draft_format): they predict the target as well as in fp32,
and speculation through them equals AR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from specpool.engine.decoding import generate
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.runtime import kernels
from specpool.engine.runtime.device import draft_format
from specpool.engine.runtime.linear import BlockLinear, Linear
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[3] / "models"
HEAD, DRAFT = MODELS / "smollm2-135m-head", MODELS / "smollm2-135m-draft"


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the engine's CPU kernels did not build: run `make setup` (needs a C++ compiler)"


@pytest.fixture(scope="module")
def target(default_format_model):
    return default_format_model[0]


@pytest.fixture(scope="module")
def prompts(default_format_model):
    tokenizer = default_format_model[1]
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in (
        "Write a Python function that checks whether a string is a palindrome.",
        "What should I pack for a weekend of hiking in the mountains?",
        "def running_mean(values):\n    \"\"\"Return the running mean of a list of numbers.\"\"\"",
    )]


def test_auto_is_q8_blocks_and_a_dtype_is_dense(target):
    assert draft_format("auto", "cpu") == draft_format(None, "cpu") == ("q4", GGMLQuantizationType.Q8_0)
    assert draft_format("fp32", "cpu") == ("fp32", None)
    head = Llama.from_draft_checkpoint(HEAD, target.embed, device="cpu")
    assert head.fused and isinstance(head.fc, BlockLinear)
    assert isinstance(head.lm_head, BlockLinear) and head.lm_head.out_features == len(head.output_ids)
    dense = Llama.from_draft_checkpoint(HEAD, target.embed, dtype="fp32", device="cpu")
    assert not dense.fused and isinstance(dense.lm_head, Linear) and dense.dtype == torch.float32


def test_the_q8_head_predicts_the_target_as_well_as_the_fp32_head(target, prompts):
    """Teacher-forced on the target's own features: the head's next-token choice agrees with the target's
    as often on Q8_0 blocks as in fp32 (they differ at near-ties only)."""
    heads = {d: Llama.from_draft_checkpoint(HEAD, target.embed, dtype=d, device="cpu") for d in ("auto", "fp32")}
    agree, same, positions = dict.fromkeys(heads, 0), 0, 0
    for prompt in prompts:
        cache = target.new_cache(1, len(prompt))
        logits, hidden = target.forward(cache, [cache.allocate()], [prompt], all_logits=True, features=True,
                                        prefill=True)
        wanted = logits[0, 1:].argmax(-1)  # the head fed (prompt[i + 1], feature i) predicts the token after
        picks = {}
        for d, head in heads.items():
            head_cache = head.new_cache(1, len(prompt))
            picks[d] = head.forward(head_cache, [head_cache.allocate()], [prompt[1:]], all_logits=True,
                                    fed_features=hidden[:, :-1])[0].argmax(-1)
            agree[d] += int((picks[d] == wanted).sum())
        same += int((picks["auto"] == picks["fp32"]).sum())
        positions += len(prompt) - 1
    assert same / positions > 0.9, same / positions
    assert abs(agree["auto"] - agree["fp32"]) / positions < 0.03, (agree, positions)


@pytest.mark.parametrize("kind", ["head", "draft"])
def test_speculation_through_q8_drafts_equals_ar(target, prompts, kind):
    ar = [r.token_ids for r in generate(target, prompts, SamplingParams(), 32)]
    model = Llama.from_draft_checkpoint(HEAD if kind == "head" else DRAFT, target.embed, device="cpu")
    drafter = (HeadDrafter if kind == "head" else ModelDrafter)(model, len(prompts), 1024)
    results = generate(target, prompts, SamplingParams(), 32, drafter, 4)
    assert [r.token_ids for r in results] == ar
    accepted = sum(r.accepted_tokens for r in results)
    assert sum(r.drafted_tokens for r in results) > 0 and accepted > 0, kind
