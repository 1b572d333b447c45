"""SSD through the servers: push and pull modes hit the speculation cache, stay equal to AR when
greedy, and stay lossless when sampling with Saguaro rescaling (sparse q on the wire), scored on
the tokens a cache hit drafts; on an endpoint with a head, SSD's forks grow from the head's predicted
features, and the same holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import save_gguf
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.remote.fallback import DeadlineBreaker
from specpool.training.distill import DraftLM, export
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import (
    PER_REQUEST,
    PROMPT,
    SAMPLES,
    STRONG_TWIN_SAMPLES,
    V,
    start_endpoint,
    start_target,
    stub_for,
)
from tests.cluster.test_head_servers import tiny_head
from tests.stats import assert_through_the_path, cells, check_tv, exact_joint, report

SSD = pb.SpeculationPreference(method=pb.SPECULATION_METHOD_SSD)


def twin_files(root: Path, vocab: int, seed: int, layers: list[int], norm_scale: float = 1.0) -> tuple[Path, Path]:
    """A tiny target and a draft made of its `layers` (all of them: a draft equal to the target);
    `norm_scale` < 1 flattens both, as in test_disaggregation.tiny_files."""
    cfg = tiny_config(vocab_size=vocab, d_model=16)
    weights = random_weights(cfg, seed=seed)
    weights["norm"] = weights["norm"] * norm_scale
    gguf = save_gguf(root / "tiny.gguf", cfg, weights)
    export(DraftLM.from_target(cfg, weights, layers, output_ids=torch.arange(vocab)), root / "draft", gguf.name)
    return gguf, root / "draft"


def greedy_through_ssd(gguf: Path, draft: Path, mode: str = "push", head: Path | None = None):
    """Four prompts, greedy, through SSD in `mode` (on the head when given): each equals AR with no
    fallback round -> the completions, and the endpoint's hit ratio."""
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7] for i in range(4)]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 40, stop_ids=[])]
    endpoint = start_endpoint(gguf, draft, head=head)
    target = start_target(gguf, endpoint, "ssd", "--draft-tokens", "3", "--ssd-mode", mode,
                          "--spec-deadline-ms", "5000")
    completions = []
    try:
        stub = stub_for(target)
        for ids, want in zip(prompts, expected):
            result = generate_result(stub, pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=40,
                                                           ignore_eos=True, speculation=SSD))
            c = result.completions[0]
            assert list(c.token_ids) == want
            assert c.speculation.method == pb.SPECULATION_METHOD_SSD and c.speculation.fallback_rounds == 0
            completions.append(c)
        return completions, endpoint.metric_total("specpool_spec_ssd_cache_hit_ratio")
    finally:
        target.stop()
        endpoint.stop()


def test_ssd_on_the_head_greedy_equals_ar_and_hits_the_cache(tmp_path):
    gguf, draft = twin_files(tmp_path, vocab=64, seed=5, layers=[0])
    completions, _ = greedy_through_ssd(gguf, draft, head=tiny_head(gguf))
    lookups = sum(c.speculation.cache_lookups for c in completions)
    hits = sum(c.speculation.cache_hits for c in completions)
    assert lookups > 20 and hits > 0, (lookups, hits)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ssd_greedy_equals_ar_and_hits_the_cache(tmp_path, mode):
    completions, hit_ratio = greedy_through_ssd(*twin_files(tmp_path, vocab=64, seed=5, layers=[0, 1]), mode)
    # The draft is the target itself: every outcome is (K, its top-1), in the cache once the fan-out
    # has learnt how often everything is accepted.
    for c in completions:
        assert c.speculation.cache_lookups > 5 and c.speculation.cache_hits >= c.speculation.cache_lookups // 2
    assert hit_ratio > 0.5


FORKS, SAGUARO_C = 4, 0.5
NEW = 6  # with 2 drafts a round the second round always has room to draft: a cache lookup
SCORED = (3, 4)  # generated tokens 4-5 (0-based 3, 4): every row's come (mostly) from its second round
# A late round falls back for every row of the target's batch (PER_REQUEST: one request at a time); the breaker
# forgives trip_after - 1 of them in a row (tests/stats.assert_through_the_path).
FORGIVEN_LATE_ROWS = (DeadlineBreaker(1.0).trip_after - 1) * PER_REQUEST


def ssd_server_check(name: str, files: tuple[Path, ...], mode: str, samples: int = SAMPLES,
                     twin: tuple[str, float] | None = None):
    """-> (TV check of generated tokens 4-5 through SSD in `mode`, shares of rows with a cache hit /
    a miss). The first round emits tokens 1-3 at most, so the second round (a lookup: a hit or a
    miss) emits token 5 or both; a row whose lookup hit scores through the cache. files: (target
    GGUF, draft[, head]): with a head, SSD runs on it."""
    gguf, draft, *head = files
    endpoint = start_endpoint(gguf, draft, "--max-sessions", str(3 * PER_REQUEST), "--max-len", "16",
                              "--ssd-sessions", str(2 * PER_REQUEST), "--ssd-fork-slots", str(FORKS * PER_REQUEST),
                              "--ssd-fork-budget", str(FORKS), "--saguaro-c", str(SAGUARO_C), twin=twin,
                              head=head[0] if head else None)
    params = SamplingParams(temperature=0.7)
    rows = []
    try:
        target = start_target(gguf, endpoint, "ssd-sampler", "--draft-tokens", "2", "--max-batch", str(PER_REQUEST),
                              "--max-context", "48", "--spec-deadline-ms", "10000", "--ssd-mode", mode)
        try:
            stub = stub_for(target)
            for seed in range(samples // PER_REQUEST):
                result = generate_result(stub, pb.GenerateRequest(
                    prompt_ids=pb.TokenIds(ids=PROMPT), max_tokens=NEW, n=PER_REQUEST, ignore_eos=True,
                    sampling=pb.SamplingParams(temperature=params.temperature, seed=seed), speculation=SSD,
                ))
                rows += [c for c in result.completions]
        except Exception:
            print(target.logs()[-3000:])
            raise
        finally:
            target.stop()
    finally:
        endpoint.stop()
    spec = [c.speculation for c in rows]
    shares = {"cache hit": sum(s.cache_hits > 0 for s in spec) / len(rows),
              "miss": sum(s.cache_lookups > s.cache_hits for s in spec) / len(rows),
              "fallback": sum(s.fallback_rounds > 0 for s in spec) / len(rows)}
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    exact = exact_joint(model, PROMPT, params, *SCORED)
    assert exact.max() < 0.5, "a near-one-hot target would hide a bias"
    return check_tv(name, cells([list(c.token_ids) for c in rows], *SCORED, V), exact), shares


@pytest.fixture(scope="module")
def ssd_files(tmp_path_factory):
    return twin_files(tmp_path_factory.mktemp("ssd-tv"), vocab=V, seed=11, layers=[0], norm_scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ssd_sampling_through_the_servers_is_lossless(ssd_files, mode):
    result, shares = ssd_server_check(f"SSD {mode}, T=0.7, Saguaro C=0.5", ssd_files, mode)
    report(result, **shares)
    assert_through_the_path(shares, result.n, forgiven_late_rows=FORGIVEN_LATE_ROWS)
    assert shares["miss"] > 0.05, shares
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", pytest.param("pull", marks=pytest.mark.full_power)])  # pull: a variant
def test_the_harness_catches_a_biased_ssd_endpoint(ssd_files, mode):
    twin, shares = ssd_server_check(f"SSD {mode}, misreported-cache-q 0.5", ssd_files, mode, STRONG_TWIN_SAMPLES,
                                    twin=("misreported-cache-q", 0.5))
    report(twin, twin=True, at_n=SAMPLES, **shares)
    assert_through_the_path(shares, twin.n, forgiven_late_rows=FORGIVEN_LATE_ROWS)
    assert not twin.passed, f"biased twin slipped through: {twin}"


@pytest.fixture(scope="module")
def ssd_head_files(tmp_path_factory):
    gguf, draft = twin_files(tmp_path_factory.mktemp("ssd-head-tv"), vocab=V, seed=11, layers=[0], norm_scale=0.3)
    return gguf, draft, tiny_head(gguf)


@pytest.mark.slow
def test_ssd_on_the_head_through_the_servers_is_lossless(ssd_head_files):
    # A variant of SSD push through the servers (the cache's q is the same mechanism; the head grows the forks).
    result, shares = ssd_server_check("SSD on the head, push, T=0.7, Saguaro C=0.5", ssd_head_files, "push")
    report(result, **shares)
    assert_through_the_path(shares, result.n, forgiven_late_rows=FORGIVEN_LATE_ROWS)
    assert shares["miss"] > 0.05, shares
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.full_power  # a variant's twin: the same cache q as SSD push's, caught there in every tier
def test_the_harness_catches_a_biased_ssd_head_endpoint(ssd_head_files):
    twin, shares = ssd_server_check("SSD on the head, push, misreported-cache-q 0.5", ssd_head_files, "push",
                                    STRONG_TWIN_SAMPLES, twin=("misreported-cache-q", 0.5))
    report(twin, twin=True, at_n=SAMPLES, **shares)
    assert_through_the_path(shares, twin.n, forgiven_late_rows=FORGIVEN_LATE_ROWS)
    assert not twin.passed, f"biased twin slipped through: {twin}"
