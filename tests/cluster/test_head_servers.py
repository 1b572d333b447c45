"""The feature-fed head through the servers: the target sends its hidden states on the tensor channel
with every round, the endpoint's head drafts chains and trees from them, and greedy output equals AR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.gguf_loader import load_gguf
from specpool.engine.model import Llama
from specpool.engine.sampling import SamplingParams
from specpool.training.head import export
from specpool.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import start_endpoint, start_target, stub_for, tiny_files
from tests.engine.test_head import train_tiny_head


def tiny_head_files(root: Path, vocab: int, seed: int, **kw) -> tuple[Path, Path, Path]:
    """tiny_files plus a head trained on the target's samples -> (target GGUF, draft, head)."""
    gguf, draft = tiny_files(root, vocab, seed, **kw)
    target = Llama.from_gguf(gguf, dtype="fp32", device="cpu")[0]
    export(train_tiny_head(target, load_gguf(gguf).weights), root / "head", gguf.name, dtype=torch.float32)
    return gguf, draft, root / "head"


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_head_drafts_through_the_servers_equal_ar(tmp_path, tree):
    gguf, draft, head = tiny_head_files(tmp_path, vocab=64, seed=5)
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7, 9, 11 + i] for i in range(3)]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 24, stop_ids=[])]
    endpoint = start_endpoint(gguf, draft, "--max-len", "64", "--tree-shape", "2,2,3", head=head)
    try:
        target = start_target(gguf, endpoint, "heads", "--draft-tokens", "4", "--max-context", "128",
                              "--spec-deadline-ms", "10000")
    except Exception:
        endpoint.stop()
        raise
    pref = pb.SpeculationPreference(method=pb.SPECULATION_METHOD_HEAD, tree=tree)
    try:
        stub = stub_for(target)
        for ids, want in zip(prompts, expected):
            c = stub.GenerateUnary(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=24, ignore_eos=True,
                                                      speculation=pref)).completions[0]
            assert list(c.token_ids) == want
            assert c.speculation.method == "head" and c.speculation.fallback_rounds == 0
            assert c.speculation.drafted_tokens > 0 and c.speculation.accepted_tokens > 0
        assert endpoint.metric_total("specpool_spec_drafted_tokens_total") > 0
    finally:
        target.stop()
        endpoint.stop()
