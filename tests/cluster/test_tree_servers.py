"""Token trees through the servers: the endpoint grows each tree session's trees (draft model or
n-gram), they travel as parents plus tokens, and the target verifies them in one forward. Greedy
equals AR; sampling at T=0.7 and 1.0 is lossless, scored on the tokens the first round's tree decides,
and the same test catches a target whose tree rule leaks the tried siblings' mass."""

from __future__ import annotations

import pytest

from specpool.engine.decoding import generate
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import (
    FULL_SAMPLES,
    PER_REQUEST,
    PROMPT,
    SAMPLES,
    STRONG_TWIN_SAMPLES,
    V,
    start_endpoint,
    start_target,
    stub_for,
    tiny_files,
)
from tests.stats import cells, check_tv, exact_joint, report

TREE = pb.SpeculationPreference(method=pb.SPECULATION_METHOD_DRAFT_MODEL, tree=True)
BUDGET = 4  # nodes a round; with the shape 2,2,3 the first round's tree is up to three deep
NEW = 6
SCORED = (1, 3)  # generated tokens 2-4: decided by the first round's tree (its path, then the target's token)


def tree_servers(gguf, draft, twin=None, max_len: int = 16):
    endpoint = start_endpoint(gguf, draft, "--max-sessions", str(3 * PER_REQUEST), "--max-len", str(max_len),
                              "--tree-shape", "2,2,3")
    try:
        target = start_target(gguf, endpoint, "trees", "--draft-tokens", str(BUDGET), "--max-batch", str(PER_REQUEST),
                              "--max-context", str(3 * max_len), "--spec-deadline-ms", "10000", twin=twin)
    except Exception:
        endpoint.stop()
        raise
    return endpoint, target


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_trees_through_the_servers_equal_ar(tmp_path, method):
    gguf, draft = tiny_files(tmp_path, vocab=64, seed=5)
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7, 9, 11 + i] for i in range(3)]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 24, stop_ids=[])]
    endpoint, target = tree_servers(gguf, draft, max_len=64)
    pref = pb.SpeculationPreference(method=pb.SpeculationMethod.Value(f"SPECULATION_METHOD_{method.upper()}"),
                                    tree=True)
    try:
        stub = stub_for(target)
        for ids, want in zip(prompts, expected):
            c = generate_result(stub, pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=24, ignore_eos=True,
                                                      speculation=pref)).completions[0]
            assert list(c.token_ids) == want
            assert c.speculation.method == pref.method and c.speculation.fallback_rounds == 0
            assert c.speculation.drafted_tokens > 0 and c.speculation.accepted_tokens > 0
        assert endpoint.metric_total("specpool_spec_drafted_tokens_total") > 0
    finally:
        target.stop()
        endpoint.stop()


def test_ssd_with_trees_is_refused_naming_the_field(tmp_path):
    import grpc

    gguf, draft = tiny_files(tmp_path, vocab=64, seed=5)
    endpoint, target = tree_servers(gguf, draft)
    try:
        with pytest.raises(grpc.RpcError) as e:
            generate_result(stub_for(target), pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=[1, 2]), max_tokens=4,
                speculation=pb.SpeculationPreference(method=pb.SPECULATION_METHOD_SSD, tree=True)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.tree" in e.value.details()
    finally:
        target.stop()
        endpoint.stop()


@pytest.fixture(scope="module")
def tv_files(tmp_path_factory):
    return tiny_files(tmp_path_factory.mktemp("tree-tv"), vocab=V, seed=11, norm_scale=0.3)


def tree_server_check(name: str, files, temperature: float, samples: int = SAMPLES, twin=None):
    """-> (TV check of generated tokens 2-4 with tree drafts, shares of rows that took a path only a
    tree has / accepted two or more drafts / drafted remotely)."""
    gguf, draft = files
    endpoint, target = tree_servers(gguf, draft, twin)
    rows = []
    try:
        stub = stub_for(target)
        for seed in range(samples // PER_REQUEST):
            result = generate_result(stub, pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=PROMPT), max_tokens=NEW, n=PER_REQUEST, ignore_eos=True,
                sampling=pb.SamplingParams(temperature=temperature, seed=seed), speculation=TREE,
            ))
            rows += list(result.completions)
    finally:
        target.stop()
        endpoint.stop()
    spec = [c.speculation for c in rows]
    shares = {
        "remote rounds": 1 - sum(s.fallback_rounds for s in spec) / sum(s.target_steps for s in spec),
        "sibling path": sum(s.branch_rounds > 0 for s in spec) / len(rows),
        "accepted 2+": sum(s.accepted_tokens >= 2 for s in spec) / len(rows),
    }
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    exact = exact_joint(model, PROMPT, SamplingParams(temperature=temperature), *SCORED)
    assert exact.max() < 0.5, "a near-one-hot target would hide a bias"
    return check_tv(name, cells([list(c.token_ids) for c in rows], *SCORED, V), exact), shares


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tree_drafts_through_the_servers_are_lossless(tv_files, temperature):
    result, shares = tree_server_check(f"trees through the servers, T={temperature}", tv_files, temperature)
    report(result, **shares)
    assert shares["remote rounds"] > 0.9 and shares["sibling path"] > 0.02 and shares["accepted 2+"] > 0.1, shares
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "strength", "samples"), [
    (0.7, 0.5, STRONG_TWIN_SAMPLES),  # fewer rows try a sibling at T 0.7: a stronger leak, fewer rows
    pytest.param(1.0, 0.03, FULL_SAMPLES, marks=pytest.mark.full_power),  # near the detection limit
])
def test_the_harness_catches_a_target_whose_tree_rule_leaks(tv_files, temperature, strength, samples):
    twin, shares = tree_server_check(f"trees, T={temperature}, leaky-siblings {strength}", tv_files, temperature,
                                     samples, twin=("leaky-siblings", strength))
    report(twin, twin=True, at_n=SAMPLES, **shares)
    assert shares["sibling path"] > 0.02, shares
    assert not twin.passed, f"biased twin slipped through: {twin}"
