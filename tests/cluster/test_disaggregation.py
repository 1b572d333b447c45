"""Target services and a pooled speculation endpoint as separate processes, end to end.

- two tenants (two target services) share one endpoint: 16 concurrent greedy requests equal
  in-process AR, and the endpoint drafted for both tenants in shared batches (real 135M model);
- killing the endpoint mid-generation loses no request, and a restarted one is used again;
- sampling through the servers is lossless: total variation with dense q over the Gloo channel and
  with sparse q over gRPC.
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from cluster.processes import ServerProcess, start_server
from engine.config import tiny_config
from engine.decoding import generate
from engine.device import native_bf16
from engine.gguf_loader import default_model_path, model_name, save_gguf
from engine.model import Llama, random_weights
from engine.sampling import SamplingParams, logits_to_probs
from specpool.v1 import target_pb2 as pb
from specpool.v1 import target_pb2_grpc
from tests.stats import tv, tv_threshold
from training.distill import DraftLM, export

REPO = Path(__file__).resolve().parents[2]
ONE_THREAD = ["--threads", "1"]


def stub_for(server: ServerProcess) -> target_pb2_grpc.TargetServiceStub:
    return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(server.address))


def tiny_files(root: Path, vocab: int, seed: int) -> tuple[Path, Path]:
    """A tiny target GGUF and a 1-layer draft distilled from nothing: its first layer and head,
    so q differs from p, as a real draft's does."""
    cfg = tiny_config(vocab_size=vocab, d_model=16)
    weights = random_weights(cfg, seed=seed)
    gguf = save_gguf(root / "tiny.gguf", cfg, weights)
    export(DraftLM.from_target(cfg, weights, [0], output_ids=torch.arange(vocab)), root / "draft", gguf.name)
    return gguf, root / "draft"


def start_endpoint(gguf: Path, draft: Path | None, *extra: str, port: int = 0) -> ServerProcess:
    spec = f"{model_name(gguf)}={gguf}" + (f",draft={draft}" if draft else "")
    return start_server("spec", ["serve-spec", "--port", str(port), "--metrics-port", "0", "--drafter", spec,
                                 *ONE_THREAD, *extra])


def start_target(gguf: Path, endpoint: ServerProcess, tenant: str, *extra: str) -> ServerProcess:
    return start_server(tenant, ["serve-target", "--model", str(gguf), "--port", "0", "--metrics-port", "0",
                                 "--spec-endpoint", endpoint.address, "--tenant", tenant, "--datastore", "",
                                 *ONE_THREAD, *extra])


# -- two tenants, one endpoint, the real model ------------------------------------------------------

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Check whether s reads the same backwards.\"\"\"\n",
    "def flatten(items):\n    \"\"\"Flatten a list of lists into one list.\"\"\"\n",
    "def count_vowels(text):\n    \"\"\"Count the vowels in text.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def celsius_to_fahrenheit(c):\n    \"\"\"Convert a temperature.\"\"\"\n",
    "def unique(items):\n    \"\"\"Return the items without duplicates, keeping order.\"\"\"\n",
    "def gcd(a, b):\n    \"\"\"Greatest common divisor of a and b.\"\"\"\n",
]


@pytest.mark.slow
def test_two_tenants_share_endpoint_batches_and_equal_ar(real_model, cpu_kind):
    model, tokenizer = real_model
    gguf = default_model_path()
    draft = REPO / "models" / "smollm2-135m-draft"
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 24)]

    # Two targets contending for 2 cores settle into anti-phase (one verifies while the other
    # waits for drafts), up to half a round apart; a window that wide lets them fall into step on
    # any machine (the default 50 ms suits GPU rounds of tens of ms).
    endpoint = start_endpoint(gguf, draft, "--batch-window-ms", "1000")
    targets = []
    try:
        # The real draft loads bf16 only where the CPU computes it natively (the default --dtype bf16).
        fell_back = "using fp32 weights" in endpoint.logs()
        assert fell_back == (cpu_kind == "no-native-bf16" or not native_bf16("cpu"))
        targets = [start_target(gguf, endpoint, t, "--draft-tokens", "4", "--max-batch", "8") for t in ("alpha", "beta")]
        stubs = [stub_for(t) for t in targets]

        def run(i: int) -> list[int]:
            result = stubs[i % 2].GenerateUnary(pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=prompts[i % 8]), max_tokens=24,
                speculation=pb.SpeculationPreference(method=pb.SPECULATION_METHOD_DRAFT_MODEL),
            ))
            assert result.completions[0].speculation.fallback_rounds == 0
            return list(result.completions[0].token_ids)

        with ThreadPoolExecutor(16) as pool:
            outputs = list(pool.map(run, range(16)))
        mismatches = [i for i in range(16) if outputs[i] != expected[i % 8]]
        assert not mismatches, f"outputs differ from AR for requests {mismatches}"
        shared = endpoint.metric_total("specpool_spec_shared_batches_total")
        assert shared > 0, f"no shared batch in {endpoint.metric_total('specpool_spec_draft_batches_total')} batches"
        for tenant in ("alpha", "beta"):
            assert endpoint.metric_total("specpool_spec_drafted_tokens_total", tenant=tenant) > 0
    finally:
        for server in [*targets, endpoint]:
            server.stop()


# -- fail open ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_killing_the_endpoint_loses_no_request_and_a_restarted_one_is_used(tmp_path):
    gguf, draft = tiny_files(tmp_path, vocab=64, seed=5)
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompts = [[3 + i, 7, 9, 11 + i, 3 + i, 7] for i in range(8)]
    expected = [r.token_ids for r in generate(model, prompts, SamplingParams(), 90, stop_ids=[])]

    endpoint = start_endpoint(gguf, draft)
    port = endpoint.port
    target = start_target(gguf, endpoint, "solo", "--draft-tokens", "3", "--max-batch", "8",
                          "--max-context", "160", "--spec-deadline-ms", "2000")
    stub = stub_for(target)
    try:
        def run(i: int) -> list[int]:
            tokens = []
            for msg in stub.Generate(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompts[i]), max_tokens=90,
                                                        stop_token_ids=[63] if i % 2 else [62])):
                if msg.HasField("delta"):
                    tokens.extend(msg.delta.token_ids)
                    if i == 0 and len(tokens) >= 10 and endpoint.alive():
                        endpoint.kill()  # mid-generation, no drain
                else:
                    assert list(msg.final.completions[0].token_ids) == tokens
            return tokens

        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(run, range(8)))
        assert not endpoint.alive()
        assert outputs == [e[:len(o)] for e, o in zip(expected, outputs)]
        assert all(len(o) == 90 or o[-1] in (62, 63) for o in outputs), "every stream completes"
        assert target.metric_total("specpool_target_spec_fallback_rounds_total") > 0

        endpoint = start_endpoint(gguf, draft, port=port)
        deadline = time.monotonic() + 15
        while not stub.GetInfo(pb.GetInfoRequest()).spec_endpoint_attached and time.monotonic() < deadline:
            time.sleep(0.1)
        result = stub.GenerateUnary(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompts[1]), max_tokens=30))
        assert list(result.completions[0].token_ids) == expected[1][:30]
        assert result.completions[0].speculation.fallback_rounds == 0
        assert endpoint.metric_total("specpool_spec_drafted_tokens_total", tenant="solo") > 0
    finally:
        target.stop()
        endpoint.stop()


# -- lossless sampling through the servers ------------------------------------------------------------

V = 8
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 100_000
PER_REQUEST = 1000


def exact_pair_distribution(model: Llama, params: SamplingParams) -> torch.Tensor:
    """p(t2, t3 | prompt), marginalising t1: [V*V], index t2*V + t3 (the tokens a drafter speculates)."""
    cache = model.new_cache(V * V + 1, 16)
    first = cache.allocate()
    p1 = logits_to_probs(model.forward(cache, [first], [PROMPT]), params)[0]
    slots = [cache.allocate() for _ in range(V * V)]
    logits = model.forward(cache, slots, [PROMPT + [a, b] for a in range(V) for b in range(V)], all_logits=True)
    p2 = logits_to_probs(logits[:, -2], params).view(V, V, V)[:, 0]
    p3 = logits_to_probs(logits[:, -1], params).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).reshape(-1)


@pytest.fixture(scope="module")
def sampling_cluster(tmp_path_factory):
    gguf, draft = tiny_files(tmp_path_factory.mktemp("tv"), vocab=V, seed=11)
    # Room for two requests: the previous one's sessions close asynchronously.
    endpoint = start_endpoint(gguf, draft, "--max-sessions", str(3 * PER_REQUEST), "--max-len", "16")
    # A generous deadline: opening 1000 sessions at once on one shared core takes a while.
    target = start_target(gguf, endpoint, "sampler", "--draft-tokens", "3", "--max-batch", str(PER_REQUEST),
                          "--max-context", "48", "--spec-deadline-ms", "10000")
    yield gguf, endpoint, target
    target.stop()
    endpoint.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "top_k"), [("dense over Gloo", 0), ("sparse over gRPC", 6)])
def test_sampling_through_the_servers_is_lossless(sampling_cluster, transport, top_k):
    gguf, endpoint, target = sampling_cluster
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    params = SamplingParams(temperature=0.9, top_k=top_k)
    stub = stub_for(target)
    dense_before = endpoint.metric_total("specpool_spec_dense_bytes_total")

    def batch(seed: int) -> list[int]:
        result = stub.GenerateUnary(pb.GenerateRequest(
            prompt_ids=pb.TokenIds(ids=PROMPT), max_tokens=5, n=PER_REQUEST, ignore_eos=True,  # 3 drafts
            sampling=pb.SamplingParams(temperature=params.temperature, top_k=top_k, seed=seed),
            speculation=pb.SpeculationPreference(method=pb.SPECULATION_METHOD_DRAFT_MODEL),
        ))
        # Mostly drafted remotely; a round drafted locally (e.g. while the tensor channel connects) is
        # verified as a point mass in the same batch, which the test then covers too.
        assert sum(c.speculation.fallback_rounds for c in result.completions) <= PER_REQUEST // 10, (
            seed, [line for line in urllib.request.urlopen(f"http://127.0.0.1:{target.metrics_port}/metrics")
                   .read().decode().splitlines() if line.startswith("specpool_target_spec_fallback")])
        assert sum(c.speculation.drafted_tokens for c in result.completions) > 0
        return [c.token_ids[1] * V + c.token_ids[2] for c in result.completions]

    pairs = [x for seed in range(SAMPLES // PER_REQUEST) for x in batch(seed)]
    exact = exact_pair_distribution(model, params)
    counts = torch.bincount(torch.tensor(pairs), minlength=V * V)
    distance = tv(counts, exact)
    threshold, floor = tv_threshold(exact, len(pairs), torch.Generator().manual_seed(0))
    print(f"{transport}: TV {distance:.4f}, threshold {threshold:.4f}, noise floor {floor:.4f}")
    assert distance < threshold
    dense_bytes = endpoint.metric_total("specpool_spec_dense_bytes_total") - dense_before
    assert (dense_bytes > 0) == (top_k == 0), f"dense q must travel on the channel only for {transport}"
