"""The bench's llama.cpp peer (bench/llamacpp_peer.py) on the shipped GGUF: its prompt lookup keeps the
target's own greedy tokens (it drafted, and kept some drafts), alone and batched, and its batched AR decodes
each sequence of a chunk. llama-cpp-python comes from `make bench-deps` (built from PyPI's source, once;
`make test` runs it); without it these tests fail, saying to run it."""

from __future__ import annotations

import importlib

import pytest

from specpool.engine.runtime.gguf_loader import default_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llamacpp():
    try:
        importlib.import_module("llama_cpp")
    except ImportError as e:
        pytest.fail(f"llama-cpp-python is not installed ({e}): run `make bench-deps`", pytrace=False)
    from specpool.bench.llamacpp_peer import LlamaCpp

    llm = LlamaCpp(default_model_path(), threads=2, sequences=2)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def prompts():
    from specpool.bench.workloads import load_workload
    from specpool.engine.runtime.gguf_loader import load_gguf
    from specpool.engine.runtime.tokenizer import Tokenizer

    return load_workload("humaneval", Tokenizer.from_gguf(load_gguf(default_model_path())), 2)


def assert_same_greedy(llamacpp, prompt, ref, out):
    """`out` is `ref`, or departs from it only where llama.cpp's top-2 logits are a near-tie."""
    from specpool.bench.llamacpp_peer import NEAR_TIE

    if out != ref:
        gap = llamacpp.divergence_gap(prompt, ref, out)
        assert gap < NEAR_TIE, f"greedy tokens differ where llama.cpp's top-2 gap is {gap}"


def test_prompt_lookup_keeps_the_targets_greedy_tokens(llamacpp, prompts):
    alone = [llamacpp.generate([p], 48, stop=False).token_ids[0] for p in prompts]
    assert all(len(t) == 48 for t in alone)
    looked_up = [llamacpp.generate([p], 48, lookup=8, stop=False).token_ids[0] for p in prompts]
    assert llamacpp.drafted > 0 and 0 < llamacpp.accepted <= llamacpp.drafted  # the lookup path ran
    for p, ref, out in zip(prompts, alone, looked_up):
        assert_same_greedy(llamacpp, p, ref, out)

    # Batched, each sequence decodes its own prompt, and lookup keeps what batched AR picks.
    batched = llamacpp.generate(prompts, 48, stop=False)
    assert [len(t) for t in batched.token_ids] == [48, 48] and batched.tokens_per_s > 0
    for p, ref, out in zip(prompts, alone, batched.token_ids):
        assert_same_greedy(llamacpp, p, ref, out)
    for p, ref, out in zip(prompts, batched.token_ids, llamacpp.generate(prompts, 48, lookup=8, stop=False).token_ids):
        assert_same_greedy(llamacpp, p, ref, out)


def test_a_sequence_ends_at_eos_or_its_limit(llamacpp, prompts):
    assert 2 in llamacpp.eog  # SmolLM2's <|im_end|>, among llama.cpp's end-of-generation tokens for it
    run = llamacpp.generate(prompts, 200, lookup=8)
    for tokens in run.token_ids:
        assert len(tokens) <= 200 and (tokens[-1] in llamacpp.eog or len(tokens) == 200)
        assert not llamacpp.eog & set(tokens[:-1])


def test_step_costs_time_each_feed():
    """T(1, 0) and T(1, 4), each the best of 5, on one thread. A step reads every weight at least once, and
    no CPU memory system here moves a terabyte a second: T(1, 0) >= file bytes / 1 TB/s (0.1 ms for this
    file; measured 9 ms on 2 threads of an Intel Xeon), and no step of a 135M model takes a second. A 5-token
    feed reads the same weights as a 1-token one and at most does the work of 5 of them: 0.5-7.5x T(1, 0)
    (measured 3.0x). One thread: with two, beside the other test worker on 2 cores, each of llama.cpp's
    barriers waited out a scheduler slice, and the best of 5 one-token steps took 2.9 s."""
    from specpool.bench.llamacpp_peer import LlamaCpp

    llm = LlamaCpp(default_model_path(), threads=1, sequences=1)
    try:
        costs = llm.step_costs([0, 4], context_len=32, repeats=5)
    finally:
        llm.close()
    floor = default_model_path().stat().st_size / 1e12
    assert all(floor <= c < 1.0 for c in costs), (costs, floor)
    assert 0.5 <= costs[1] / costs[0] <= 7.5, costs
