"""The feature-fed head through the servers: the target sends its hidden states on the tensor channel
with every round, the endpoint's head drafts chains and trees from them; greedy output equals AR, and
sampled head chains are lossless (q sparse over gRPC and dense over Gloo), scored as the draft
model's are (tests/cluster/test_disaggregation.py), with the same biased twin caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.runtime.gguf_loader import load_gguf
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool.training.head import export
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import (
    SAMPLES,
    STRONG_TWIN_SAMPLES,
    TRANSPORTS,
    V,
    sampling_servers,
    server_check,
    start_endpoint,
    start_target,
    stub_for,
    tiny_files,
)
from tests.engine.drafters.test_head import train_tiny_head
from tests.stats import report


def tiny_head(gguf: Path) -> Path:
    """A head for a tiny target, trained on its own samples, exported next to it."""
    target = Llama.from_gguf(gguf, dtype="fp32", device="cpu")[0]
    export(train_tiny_head(target, load_gguf(gguf).weights), gguf.parent / "head", gguf.name, dtype=torch.float32)
    return gguf.parent / "head"


def tiny_head_files(root: Path, vocab: int, seed: int, **kw) -> tuple[Path, Path, Path]:
    """tiny_files plus a head -> (target GGUF, draft, head)."""
    gguf, draft = tiny_files(root, vocab, seed, **kw)
    return gguf, draft, tiny_head(gguf)


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
            c = generate_result(stub, pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=24, ignore_eos=True,
                                                      speculation=pref)).completions[0]
            assert list(c.token_ids) == want
            assert c.speculation.method == pb.SPECULATION_METHOD_HEAD and c.speculation.fallback_rounds == 0
            assert c.speculation.drafted_tokens > 0 and c.speculation.accepted_tokens > 0
        assert endpoint.metric_total("specpool_spec_drafted_tokens_total") > 0
    finally:
        target.stop()
        endpoint.stop()


@pytest.fixture(scope="module")
def head_sampling_files(tmp_path_factory):
    return tiny_head_files(tmp_path_factory.mktemp("head-tv"), vocab=V, seed=11, norm_scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sampled_head_drafts_through_the_servers_are_lossless(head_sampling_files, transport):
    with sampling_servers(head_sampling_files) as (endpoint, target):
        result, shares = server_check(f"head, {transport}", head_sampling_files[0], target,
                                      SamplingParams(temperature=0.9, top_k=TRANSPORTS[transport]),
                                      method=pb.SPECULATION_METHOD_HEAD)
        dense_bytes = endpoint.metric_total("specpool_spec_dense_bytes_total")
    report(result, **shares)
    assert shares["remote rounds"] > 0.9 and shares["drafted K"] > 0.9 and shares["bonus"] > 0.05, shares
    assert result.passed, result
    assert (dense_bytes > 0) == (TRANSPORTS[transport] == 0), f"dense q must travel on the channel only for {transport}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", [  # sparse q: the same head and twin, a variant of the transport
    "dense over Gloo", pytest.param("sparse over gRPC", marks=pytest.mark.full_power)])
def test_the_harness_catches_a_head_that_misreports_q(head_sampling_files, transport):
    with sampling_servers(head_sampling_files, twin=("misreported-q", 0.3)) as (_, target):
        twin, shares = server_check(f"head, {transport}, misreported-q 0.3", head_sampling_files[0], target,
                                    SamplingParams(temperature=0.9, top_k=TRANSPORTS[transport]),
                                    STRONG_TWIN_SAMPLES, method=pb.SPECULATION_METHOD_HEAD)
    report(twin, twin=True, at_n=SAMPLES, **shares)
    assert shares["remote rounds"] > 0.9, shares
    assert not twin.passed, f"biased twin slipped through: {twin}"
