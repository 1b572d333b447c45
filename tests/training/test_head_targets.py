"""`specpool train-draft --kind head` on a target other than the default SmolLM2 GGUF (issue 37): a tiny
random Llama 3.1 (llama3 RoPE scaling, an output head of its own) saved as a Hugging Face directory with a
tokenizer and chat template, trained for seconds by the command's entry point. The endpoint hosts the head
against that target, its speculation equals plain greedy decoding, and it refuses the head for any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import specpool.training
from specpool.engine.decoding import generate
from specpool.engine.method import Method
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool.spec_endpoint.drafters import DrafterSpec, LoadOptions, ModelDrafters
from specpool.training.train_head import TrainHeadConfig, run
from tests.engine.runtime.test_families import hf_model, one_thread  # noqa: F401 (one_thread: an autouse fixture)
from tests.engine.runtime.test_hf_files import save_byte_tokenizer

OPTIONS = LoadOptions(max_sessions=4, max_len=256, device=torch.device("cpu"), dtype="fp32")
# save_byte_tokenizer's vocabulary: 256 bytes and 4 special tokens (<|bos|> 256, <|eos|> 257), 4 spare rows.
SHAPE = {"vocab_size": 264, "bos_token_id": 256, "eos_token_id": 257, "max_position_embeddings": 1024}


def _target(directory: Path, family: str = "llama3", seed: int = 0, **overrides) -> Path:
    hf_model(family, seed, **(SHAPE | overrides)).save_pretrained(directory)
    save_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the target's directory, the head's, the training report): seconds of data and training, prompts
    from this package's own sources (the stdlib's and every installed package's take minutes to parse)."""
    root = tmp_path_factory.mktemp("head-targets")
    target = _target(root / "Llama-tiny")
    cfg = TrainHeadConfig(target=target, out=root / "head", work_dir=root / "work", data_minutes=0.1,
                          train_minutes=0.1, max_new_tokens=32, gen_batch=16, train_batch=4, window=64,
                          generated_requests=8, prompt_roots=(Path(specpool.training.__file__).parent,))
    return target, cfg.out, run(cfg)


def test_a_head_trained_on_a_directory_target_speculates_as_it_decodes(trained):
    target_dir, head_dir, report = trained
    assert report["train_steps"] > 0 and report["corpus_sequences"] > 0
    assert all(row["outputs_match_ar"] for row in report["heldout_acceptance_greedy"])
    meta = json.loads((head_dir / "config.json").read_text())
    assert meta["embeddings_from"] == "Llama-tiny" and meta["draft_vocab"] <= SHAPE["vocab_size"]
    assert meta["config"]["feature_fed"] and meta["config"]["rope_scaling"] is not None

    drafters = ModelDrafters.load(DrafterSpec.parse(f"{target_dir},head={head_dir}"), OPTIONS)
    head = drafters.drafter(Method.HEAD)
    target, tokenizer = Llama.from_path(target_dir, dtype="fp32", device="cpu")
    asks = ["Write a Python function that adds two numbers.", "Summarize the plot of a short story.",
            "List three uses of a hammer.", "Explain what a dictionary is in Python."]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]
    ar = generate(target, prompts, SamplingParams(), 48, stop_ids=[])
    spec = generate(target, prompts, SamplingParams(), 48, head, num_draft_tokens=3, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    # The head drafted for every prompt (seconds of training on a random target accept few: ~1%, not asserted).
    assert all(r.drafted_tokens > 0 for r in spec)


def test_the_endpoint_refuses_the_head_for_another_target(trained, tmp_path):
    _, head_dir, _ = trained
    other = _target(tmp_path / "Llama-other", seed=1)  # the same shape, other weights
    with pytest.raises(ValueError, match=r"--drafter Llama-other: head .*head was trained for Llama-tiny \(264 "
                                         r"tokens x 64\), not for .*Llama-other \(264 tokens x 64\): the "
                                         r"embeddings are another model's"):
        ModelDrafters.load(DrafterSpec.parse(f"{other},head={head_dir}"), OPTIONS)
    smaller = _target(tmp_path / "Qwen-tiny", "qwen2", vocab_size=260)
    with pytest.raises(ValueError, match=r"not for .*Qwen-tiny \(260 tokens x 64\): the embedding tables differ"):
        ModelDrafters.load(DrafterSpec.parse(f"{smaller},head={head_dir}"), OPTIONS)
