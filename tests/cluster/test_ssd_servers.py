"""SSD through the servers: push and pull modes hit the speculation cache, stay equal to AR when
greedy, and stay lossless when sampling with Saguaro rescaling (sparse q on the wire)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import tiny_config
from engine.decoding import generate
from engine.gguf_loader import save_gguf
from engine.model import Llama, random_weights
from engine.sampling import SamplingParams
from specpool.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import (
    PER_REQUEST,
    PROMPT,
    SAMPLES,
    V,
    exact_pair_distribution,
    start_endpoint,
    start_target,
    stub_for,
)
from tests.stats import tv, tv_threshold
from training.distill import DraftLM, export

SSD = pb.SpeculationPreference(method=pb.SPECULATION_METHOD_SSD)


def twin_files(root: Path, vocab: int, seed: int, layers: list[int]) -> tuple[Path, Path]:
    """A tiny target and a draft made of its `layers` (all of them: a draft equal to the target)."""
    cfg = tiny_config(vocab_size=vocab, d_model=16)
    weights = random_weights(cfg, seed=seed)
    gguf = save_gguf(root / "tiny.gguf", cfg, weights)
    export(DraftLM.from_target(cfg, weights, layers, output_ids=torch.arange(vocab)), root / "draft", gguf.name)
    return gguf, root / "draft"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ssd_greedy_equals_ar_and_hits_the_cache(tmp_path, mode):
    gguf, draft = twin_files(tmp_path, vocab=64, seed=5, layers=[0, 1])
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7] for i in range(4)]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 40, stop_ids=[])]
    endpoint = start_endpoint(gguf, draft)
    target = start_target(gguf, endpoint, "ssd", "--draft-tokens", "3", "--ssd-mode", mode,
                          "--spec-deadline-ms", "5000")
    try:
        stub = stub_for(target)
        for ids, want in zip(prompts, expected):
            result = stub.GenerateUnary(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=40,
                                                           ignore_eos=True, speculation=SSD))
            c = result.completions[0]
            assert list(c.token_ids) == want
            assert c.speculation.method == "ssd" and c.speculation.fallback_rounds == 0
            # The draft is the target itself: every outcome is (K, its top-1), in the cache once the
            # fan-out has learnt how often everything is accepted.
            assert c.speculation.cache_lookups > 5 and c.speculation.cache_hits >= c.speculation.cache_lookups // 2
        assert endpoint.metric_total("specpool_spec_ssd_cache_hit_ratio") > 0.5
    finally:
        target.stop()
        endpoint.stop()


@pytest.mark.slow
def test_ssd_sampling_through_the_servers_is_lossless(tmp_path):
    gguf, draft = twin_files(tmp_path, vocab=V, seed=11, layers=[0])
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    endpoint = start_endpoint(gguf, draft, "--max-sessions", str(3 * PER_REQUEST), "--max-len", "16",
                              "--ssd-sessions", str(2 * PER_REQUEST), "--ssd-fork-slots", str(6 * PER_REQUEST),
                              "--ssd-fork-budget", "3", "--saguaro-c", "0.5")
    target = start_target(gguf, endpoint, "ssd-sampler", "--draft-tokens", "2", "--max-batch", str(PER_REQUEST),
                          "--max-context", "48", "--spec-deadline-ms", "10000")
    params = SamplingParams(temperature=1.0)
    try:
        stub = stub_for(target)
        pairs, hits = [], 0
        for seed in range(SAMPLES // PER_REQUEST):
            result = stub.GenerateUnary(pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=PROMPT), max_tokens=5, n=PER_REQUEST, ignore_eos=True,
                sampling=pb.SamplingParams(temperature=params.temperature, seed=seed), speculation=SSD,
            ))
            pairs += [c.token_ids[1] * V + c.token_ids[2] for c in result.completions]
            hits += sum(c.speculation.cache_hits for c in result.completions)
        assert hits > 0
        exact = exact_pair_distribution(model, params)
        distance = tv(torch.bincount(torch.tensor(pairs), minlength=V * V), exact)
        threshold, _ = tv_threshold(exact, len(pairs), torch.Generator().manual_seed(0))
        print(f"SSD push, Saguaro C=0.5: TV {distance:.4f}, threshold {threshold:.4f}, hits {hits}")
        assert distance < threshold
    except Exception:
        print(target.logs()[-3000:])
        raise
    finally:
        target.stop()
        endpoint.stop()
