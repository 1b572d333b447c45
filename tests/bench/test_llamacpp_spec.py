"""llama.cpp's own draft-model speculation as a bench peer (bench/llamacpp_spec.py, mode llamacpp-sd): its
report parsed from a real run's output (fixtures/llama_speculative_simple.json), outputs compared as text, and,
slow, the Qwen2.5-Coder pair through the built llama-speculative-simple against llama.cpp's own AR."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpool.bench.llamacpp_spec import Vocab, parse_output

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_speculative_simple.json").read_text())


def test_the_report_of_a_real_run_parses():
    run = parse_output(FIXTURE["stdout"].encode(), FIXTURE["stderr"], FIXTURE["prompt"].encode())
    assert run.text.decode() == ("    for i in range(len(numbers)):\n        for j in range(i + 1, len(numbers)):\n"
                                 "            if abs(numbers[i] - numbers[j]) < threshold:\n               ")
    assert (run.prompt_tokens, run.encode_s, run.decode_s) == (118, 3.975, 9.966)
    assert (run.draft_max, run.n_predict, run.n_drafted, run.n_accept) == (4, 35, 28, 28)
    assert run.target_steps == 7 and run.acceptance == 1.0  # 7 steps of 4 accepted drafts and a token of its own


def test_a_report_that_is_not_a_finished_run_is_refused():
    stdout, stderr, prompt = FIXTURE["stdout"].encode(), FIXTURE["stderr"], FIXTURE["prompt"].encode()
    with pytest.raises(ValueError, match="does not begin with the prompt"):
        parse_output(stdout, stderr, b"another prompt")
    with pytest.raises(ValueError, match="does not end"):
        parse_output(stdout[:-2], stderr, prompt)
    with pytest.raises(ValueError, match="no 'decode' line"):
        parse_output(stdout, stderr.replace("decoded", "skipped"), prompt)


class FakeVocab(Vocab):
    """One byte per token (its id), end-of-generation 0: Vocab's comparison without a model file."""

    def __init__(self):
        self.eog = frozenset({0})

    def piece(self, token: int) -> bytes:
        return bytes([token])


def test_outputs_are_the_same_text_though_split_or_cut_otherwise():
    v = FakeVocab()
    assert v.same_output(list(b"abc"), list(b"abcd"))  # cut at the token limit in another place
    assert v.same_output([*b"ab", 0], [*b"ab", 0])  # both ended at end-of-generation
    assert not v.same_output([*b"ab", 0], list(b"abc"))  # one ended there, the other went on
    assert not v.same_output(list(b"abx"), list(b"abc"))


@pytest.mark.slow
def test_the_qwen_pair_drafts_and_keeps_llamacpps_own_greedy_output():
    """HumanEval/0, 32 tokens, draft max 4: llama-speculative-simple drafted, and its text is llamacpp-ar's (or
    departs where llama.cpp's top-2 logits are a near-tie). One thread each: two spin-waiting threads on a
    2-core machine shared with other tests wait out scheduler slices at every barrier. The first run builds the
    binary (about 4 minutes on 2 cores)."""
    from specpool.bench.llamacpp_peer import NEAR_TIE, LlamaCpp
    from specpool.bench.llamacpp_spec import LlamaCppSpeculative
    from specpool.bench.workloads import load_workload
    from specpool.engine.runtime.chunked_models import ModelNotAssembled, model_path
    from specpool.engine.runtime.gguf_loader import load_gguf
    from specpool.engine.runtime.tokenizer import Tokenizer

    try:
        target, draft = model_path("qwen2.5-coder-1.5b"), model_path("qwen2.5-coder-0.5b")
    except ModelNotAssembled as e:
        pytest.skip(str(e))
    [prompt] = load_workload("humaneval", Tokenizer.from_gguf(load_gguf(target)), 1)
    sd = LlamaCppSpeculative(target, draft, threads=1)
    ar = LlamaCpp(target, threads=1, sequences=1)
    try:
        [out] = sd.generate([prompt], 32, draft_max=4).token_ids
        [run] = sd.runs
        [ref] = ar.generate([prompt], 32).token_ids
        assert run.draft_max == 4 and run.n_drafted > 0 and run.n_accept <= run.n_drafted, run
        assert run.n_predict >= 32 and run.decode_s > 0 and run.encode_s > 0, run
        assert len(out) == len(ref) == 32
        if not sd.vocab.same_output(ref, out):
            gap = ar.divergence_gap(prompt, ref, out)
            assert gap < NEAR_TIE, (f"llamacpp-sd's text departs from llamacpp-ar's where the top-2 gap is {gap}",
                                    sd.vocab.text(ref), sd.vocab.text(out))
    finally:
        sd.close()
        ar.close()
