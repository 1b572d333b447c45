# Over 400 lines: the q4 format on both its paths (the engine's kernels, torch int4), on the shipped model and on K-quant files.
"""The q4 format (engine/runtime/device.py resolve_format): the GGUF's own blocks through the engine's kernels
(engine/runtime/linear.py BlockLinear, fused layers: tests/engine/runtime/test_kernels.py tests the kernels themselves) or,
where they cannot be built, through torch's int4 kernel (Int4Linear, against dequantize-then-matmul);
both against the fp32 path and against their own decoding, bit for bit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specpool.engine.decoding import generate
from specpool.engine.policy.costs import cached_step_costs
from specpool.engine.runtime import device, kernels
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import QuantizedBlocks, load_gguf, save_gguf
from specpool.engine.runtime.linear import BlockLinear, Int4Linear, Linear
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.runtime.process_env import NO_NATIVE_BF16
from specpool.engine.verification.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[3] / "models"

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
U = 2.0**-8  # bf16's unit roundoff: round to nearest with 8 significant bits


def _blocks(kind, rows: int, cols: int, seed: int = 0) -> QuantizedBlocks:
    w = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return QuantizedBlocks(kind, (rows, cols), quantize(w, kind))


def _kernel_constants(blocks: QuantizedBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(|q - 8| * |scale| + |zero|, the weights) per weight: how far bf16 constants can move a weight."""
    fields = blocks.fields()
    d, q = fields[0], fields[-1].float()
    zero = fields[1] + 8 * d if blocks.kind == Q4_1 else torch.zeros_like(d)
    spread = (q - 8).abs() * d.abs().repeat_interleave(32, 1) + zero.abs().repeat_interleave(32, 1)
    return spread, blocks.dequantize()


def assert_within_bf16_rounding(lin: Int4Linear, blocks: QuantizedBlocks, x: torch.Tensor) -> None:
    """The kernel's output against the exact product of its bf16 input with the file's weights (fp64):
    within the bf16 rounding of the per-group constants (relative U on each) and of the output
    (relative U), plus fp32 accumulation."""
    xb = x.to(torch.bfloat16).double()
    spread, w = _kernel_constants(blocks)
    exact = xb @ w.double().T
    bound = U * (xb.abs() @ spread.double().T + 1.01 * exact.abs()) + 1e-5 * (xb.abs() @ w.double().abs().T)
    got = lin(x).double()
    assert (got - exact).abs().le(bound).all(), float(((got - exact).abs() / bound).max())


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0])
def test_blocks_read_as_gguf_dequantizes_them(kind):
    blocks = _blocks(kind, 48, 96)
    fields = blocks.fields()
    d, q = fields[0].repeat_interleave(32, 1), fields[-1].float()
    mine = {Q4_0: lambda: d * (q - 8), Q4_1: lambda: d * q + fields[1].repeat_interleave(32, 1),
            Q8_0: lambda: d * q}[kind]()
    assert torch.equal(mine, blocks.dequantize())
    both = QuantizedBlocks.cat([blocks, _blocks(kind, 16, 96, seed=1)])
    assert both.shape == (64, 96) and torch.equal(both.dequantize()[:48], blocks.dequantize())


@pytest.mark.parametrize("kind", [Q4_0, Q4_1])
def test_int4_linear_is_dequantize_then_matmul_within_bf16_rounding(kind):
    blocks = _blocks(kind, 64, 160)
    lin = Int4Linear.from_blocks(blocks, prefill=Linear(blocks.dequantize()))
    x = torch.randn(9, 160)
    assert_within_bf16_rounding(lin, blocks, x)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (9, 64)
    # Each row alone gives the same bits as in any block of rows: verify rows equal decode rows.
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(9)]), y)
    assert torch.equal(lin(x.view(3, 3, 160)), y.view(3, 3, 64))


def test_int4_linear_reads_only_4_bit_blocks_of_16_outputs():
    assert Int4Linear.supports(_blocks(Q4_1, 16, 32))
    assert not Int4Linear.supports(_blocks(Q8_0, 16, 32))  # stays dense
    assert not Int4Linear.supports(_blocks(Q4_1, 24, 32))  # the kernel packs outputs by 16


def test_q4_format_resolves_per_machine(monkeypatch, caplog):
    fmt = device.resolve_format("q4", "cpu")  # the engine's kernels build here (make setup)
    assert fmt.int4 and fmt.own_kernels and fmt.dtype == torch.float32 and fmt.name == "q4"
    # auto: q4 for a 4-bit file, the dense rule (fp32 on CPU) for any other.
    assert device.resolve_format("auto", "cpu") == device.resolve_format(None, "cpu") == fmt
    assert device.resolve_format("auto", "cpu", four_bit=False) == device.WeightFormat(torch.float32)
    monkeypatch.setattr(kernels, "available", lambda: False)  # no compiler: torch's int4 kernel
    monkeypatch.setattr(device, "int4_kernels", lambda dev: True)
    fmt = device.resolve_format("q4", "cpu")
    assert fmt.int4 and not fmt.own_kernels and fmt.dtype == torch.float32 and fmt.name == "q4"
    assert fmt.dense_dtype == (torch.bfloat16 if device.native_bf16("cpu") else torch.float32)
    assert device.resolve_format("auto", "cpu") == fmt
    assert device.resolve_format("fp32", "cpu") == device.WeightFormat(torch.float32)
    monkeypatch.setattr(device, "int4_kernels", lambda dev: False)  # a CPU without AVX2: a scalar loop
    assert device.resolve_format("auto", "cpu") == device.WeightFormat(torch.float32)  # no log: not asked for
    with caplog.at_level(logging.WARNING, logger="specpool.engine.runtime.device"):
        assert device.resolve_format("q4", "cpu") == device.WeightFormat(torch.float32)
    assert any("int4 kernel has no fast path" in r.message for r in caplog.records)


def test_auto_loads_the_default_model_as_q4_and_a_draft_on_q8_blocks(shipped, q4_model):
    auto = Llama(shipped.config, shipped.weights, "auto", "cpu", blocks=shipped.blocks)
    assert auto.format == q4_model.format and auto.fused
    draft = Llama.from_draft_checkpoint(MODELS / "smollm2-135m-draft", auto.embed, dtype="auto", device="cpu")
    assert draft.fused and draft.format.own_kernels  # its matrices quantized to Q8_0 (tests/engine/runtime/test_draft_format.py)
    dense = Llama.from_draft_checkpoint(MODELS / "smollm2-135m-draft", auto.embed, dtype="fp32", device="cpu")
    assert dense.format == device.WeightFormat(torch.float32)


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory):
    config = tiny_config(vocab_size=64)
    path = tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"
    return save_gguf(path, config, random_weights(config, seed=4), quantize_layers=Q4_1)


@pytest.mark.parametrize("own_kernels", [True, False], ids=["own kernels", "torch int4"])
def test_tiny_q4_model_runs_its_blocks_and_stays_close_to_fp32(tiny_q4_gguf, tmp_path, own_kernels, monkeypatch):
    if not own_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    q4, _ = Llama.from_gguf(tiny_q4_gguf, dtype="q4", device="cpu")
    fp32, _ = Llama.from_gguf(tiny_q4_gguf, dtype="fp32", device="cpu")
    assert q4.format.int4 and not fp32.format.int4 and q4.fused == own_kernels
    layer = q4.layers[0]
    kind = BlockLinear if own_kernels else Int4Linear
    assert all(isinstance(layer[k], kind) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(q4.lm_head, Linear) and isinstance(fp32.layers[0]["wqkv"], Linear)  # F32 in the file: dense

    prompt = [1, 5, 9, 13, 17, 21, 25, 29]
    outs = []
    for m in (q4, fp32):
        cache = m.new_cache(1, 32)
        outs.append(m.forward(cache, [cache.allocate()], [prompt], all_logits=True))
    assert outs[0].dtype == torch.float32
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[1].abs().max()

    # Greedy speculation through the q4 path equals its own AR decoding. Both prefill through the dense
    # twins (once each), and decode or verify through the int4 kernel only.
    calls = {"int4": 0, "prefill": 0}
    for layer in q4.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            layer[name] = _Counted(layer[name], calls)
    ar = generate(q4, [prompt], SamplingParams(), 16, stop_ids=[])[0].token_ids
    assert calls == {"int4": 15 * 4 * len(q4.layers), "prefill": 4 * len(q4.layers)}
    from specpool.engine.drafters.ngram import NgramDrafter
    sd = generate(q4, [prompt], SamplingParams(), 16, NgramDrafter(), 3, stop_ids=[])[0].token_ids
    assert sd == ar
    assert calls["prefill"] == 2 * 4 * len(q4.layers)

    # Each format gets a cost table of its own.
    kwargs = {"batch_sizes": (1,), "draft_lens": (0, 1), "context_len": 8, "repeats": 1}
    cached_step_costs(q4, "tiny", tmp_path, **kwargs)
    cached_step_costs(fp32, "tiny", tmp_path, **kwargs)
    keys = sorted(json.loads(p.read_text())["key"].split("|")[3] for p in tmp_path.iterdir())
    assert keys == ["fp32", "q4"]


class _Counted:
    """A q4 matrix that counts its products through the int4 kernel and through its dense prefill twin."""

    def __init__(self, inner: Int4Linear, calls: dict[str, int]):
        self.inner, self.calls = inner, calls

    def __call__(self, x, *args, **kwargs):
        self.calls["int4"] += 1
        return self.inner(x, *args, **kwargs)

    @property
    def prefill(self):
        def dense(x, *norm):
            self.calls["prefill"] += 1
            return self.inner.prefill(x, *norm)

        return dense


PROBE = """
import specpool  # first, as in every specpool process: engine/runtime/process_env.py, before torch loads
import json, sys, torch
from specpool.engine.runtime.device import cpu_class
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.device import kernel_amx, kernel_isa
m, _ = Llama.from_gguf(sys.argv[1], dtype="q4", device="cpu")
cache = m.new_cache(1, 16)
slot = cache.allocate()
m.forward(cache, [slot], [[1, 2, 3]])
logits = m.forward(cache, [slot], [[4]])  # a decode step: the fused layers
print(json.dumps(cpu_class() | {"matrices": type(m.layers[0]["wqkv"]).__name__, "fused": m.fused,
                                "kernel_isa": kernel_isa(), "amx": kernel_amx(), "head": str(m.format.dense_dtype),
                                "finite": bool(logits.isfinite().all())}))
"""


def test_q4_runs_on_an_avx2_machine(tiny_q4_gguf):
    """In a fresh process acting as an AVX2 CPU, the engine's kernels built for AVX2 run the 4-bit matrices
    and the fused layers; the dense ones are fp32, as bf16 is not native there."""
    env = {**os.environ, NO_NATIVE_BF16: "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_q4_gguf)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cpu_capability"] == "AVX2" and got["native_bf16"] is False
    assert got["matrices"] == "BlockLinear" and got["fused"] and got["kernel_isa"] == "avx2" and got["amx"] is False
    assert got["head"] == "torch.float32" and got["finite"]


# -- the shipped model -------------------------------------------------------------------------------

FACTORIAL = "Write a Python function that returns the factorial of n."
# A top-2 gap this small is within q4's own distance from the fp32 path (bf16 inputs to every matmul,
# bf16 logits where the head is bf16: max |logit diff| ~0.6, mean ~0.07 over 300 tokens), so either
# token is the model's; fp32 paths use 1e-4 (tests/engine/runtime/test_real_model.py).
Q4_NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def shipped():
    from specpool.engine.runtime.gguf_loader import default_model_path

    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def q4_model(shipped):
    """q4 as every machine with a C++ compiler runs it: the engine's kernels, fused layers."""
    model = Llama(shipped.config, shipped.weights, "q4", "cpu", blocks=shipped.blocks)
    assert model.fused and isinstance(model.lm_head, BlockLinear)  # the Q8_0 head on its blocks too
    return model


@pytest.fixture(scope="module")
def q4_int4_model(shipped):
    """q4 where the kernels cannot be built: torch's int4 kernel, float64 attention."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "available", lambda: False)
        model = Llama(shipped.config, shipped.weights, "q4", "cpu", blocks=shipped.blocks)
    assert not model.fused and isinstance(model.layers[0]["wqkv"], Int4Linear)
    return model


Q4_PATHS = pytest.mark.parametrize("q4_path", ["q4_model", "q4_int4_model"], ids=["own kernels", "torch int4"])
# How far each path's logits may sit from the fp32 path's (the test's 300 tokens): torch's int4 kernel takes
# bf16 inputs; the engine's kernels quantize each row's activations to int8 per group of 32 (as llama.cpp
# does) and read the head's Q8_0 blocks. Measured (AMD EPYC, AVX-512): max 0.95 / mean 0.11 / argmax 0.96,
# and 1.89 / 0.155 / 0.953.
FP32_DISTANCE = {"q4_int4_model": (2.0, 0.1, 0.95), "q4_model": (2.5, 0.2, 0.93)}


@pytest.mark.slow
def test_int4_linear_on_the_shipped_blocks(shipped):
    kinds = {b.kind for b in shipped.blocks.values()}
    assert kinds == {Q4_1, Q8_0}  # the layers' matrices, and the tied embedding / LM head
    torch.manual_seed(0)
    for name in ("layers.0.wq", "layers.0.w_gate", "layers.15.w_down", "layers.29.wo"):
        blocks = shipped.blocks[name]
        assert blocks.kind == Q4_1 and torch.equal(blocks.dequantize(), shipped.weights[name])
        x = torch.randn(5, blocks.shape[1]) * 2
        assert_within_bf16_rounding(Int4Linear.from_blocks(blocks, prefill=Linear(blocks.dequantize())), blocks, x)


def _all_logits(model, tokens):
    cache = model.new_cache(1, len(tokens))
    return model.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]


@pytest.mark.slow
@Q4_PATHS
def test_q4_logits_and_greedy_tokens_against_the_fp32_path(real_model, q4_path, request):
    model, tokenizer = real_model
    q4_model = request.getfixturevalue(q4_path)
    max_diff, mean_diff, min_agree = FP32_DISTANCE[q4_path]
    text = Path(__file__).read_text()[:3000]
    tokens = [model.config.bos_id] + tokenizer.encode(text)[:299]
    ref, got = _all_logits(model, tokens), _all_logits(q4_model, tokens)
    diff = (got - ref).abs()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"q4 vs fp32 over {len(tokens)} tokens: max |logit diff| {diff.max():.3f}, "
          f"mean {diff.mean():.4f}, argmax agreement {agree:.3f}")
    assert diff.max() < max_diff and diff.mean() < mean_diff and agree > min_agree

    # Greedy decoding of the reference prompt: the same tokens, or a first divergence at a near-tie of
    # the fp32 path, within the two paths' logit difference there.
    prompt = tokenizer.encode_chat([{"role": "user", "content": FACTORIAL}])
    want = generate(model, [prompt], SamplingParams(), 128, stop_ids=[])[0].token_ids
    have = generate(q4_model, [prompt], SamplingParams(), 128, stop_ids=[])[0].token_ids
    if have != want:
        i = next(j for j, (a, b) in enumerate(zip(want, have)) if a != b)
        context = prompt + want[:i]
        ref, got = _all_logits(model, context)[-1], _all_logits(q4_model, context)[-1]
        gap = float(ref[want[i]] - ref[have[i]])
        print(f"greedy: first divergence at token {i}, fp32 top-2 gap there {gap:.4f}")
        assert 0 <= gap < Q4_NEAR_TIE and gap <= 2 * float((got - ref).abs().max())


@pytest.mark.slow
@Q4_PATHS
def test_q4_decode_verify_and_batch_rows_are_the_same_bits(real_model, q4_path, request):
    """Every op of the q4 forward works row by row, and attention over exactly each query's keys (the
    engine's kernel) or in float64 (torch's path), so a token's logits are the same bits whichever step
    computes them: a decode row, a verify row, a token tree's path, a batch row. Greedy speculation and
    batching equal q4's AR decoding."""
    from specpool.engine.drafters.lookup import SuffixArrayDatastore
    from specpool.engine.drafters.model import ModelDrafter
    from specpool.engine.drafters.ngram import NgramDrafter

    _, tokenizer = real_model
    q4_model = request.getfixturevalue(q4_path)
    questions = [FACTORIAL, "Write a haiku about the sea.", "Explain the difference between a list and a tuple."]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    alone = [generate(q4_model, [p], SamplingParams(), 48, stop_ids=[])[0].token_ids for p in prompts]

    cache = q4_model.new_cache(1, 128)
    slot = cache.allocate()
    stepped = [q4_model.forward(cache, [slot], [prompts[0]])[0]]
    stepped += [q4_model.forward(cache, [slot], [[t]])[0] for t in alone[0][:-1]]
    at_once = _all_logits(q4_model, prompts[0] + alone[0][:-1])[len(prompts[0]) - 1 :]
    assert torch.equal(torch.stack(stepped), at_once)
    # A verify step of 9 rows after the prompt (K = 8), and a token tree holding the path beside a sibling.
    cache = q4_model.new_cache(1, 128)
    slot = cache.allocate()
    q4_model.forward(cache, [slot], [prompts[0]])
    verify = q4_model.forward(cache, [slot], [alone[0][:9]], all_logits=True)[0]
    assert torch.equal(verify, torch.stack(stepped[1:10]))
    cache = q4_model.new_cache(1, 128)
    slot = cache.allocate()
    q4_model.forward(cache, [slot], [prompts[0]])
    other = (alone[0][0] + 1) % q4_model.config.vocab_size
    tree = q4_model.forward(cache, [slot], [[alone[0][0], other, alone[0][1], alone[0][2]]], all_logits=True,
                            parents=[[-1, -1, 0, 2]])[0]
    assert torch.equal(tree[[0, 2, 3]], torch.stack(stepped[1:4]))

    assert [r.token_ids for r in generate(q4_model, prompts, SamplingParams(), 48, stop_ids=[])] == alone
    store = SuffixArrayDatastore.load(MODELS / "smollm2-135m-datastore.npz")
    for k in (2, 8):
        sd = generate(q4_model, prompts, SamplingParams(), 48, NgramDrafter(store), k, stop_ids=[])
        assert [r.token_ids for r in sd] == alone
    draft = Llama.from_draft_checkpoint(MODELS / "smollm2-135m-draft", q4_model.embed, dtype="bf16", device="cpu")
    sd = generate(q4_model, prompts, SamplingParams(), 48, ModelDrafter(draft, len(prompts), 512), 4, stop_ids=[])
    assert [r.token_ids for r in sd] == alone


@pytest.mark.slow
def test_q4_prompts_prefill_to_the_same_bits_alone_or_batched(real_model, q4_model):
    """A prompt's prefill runs the dense twin in bf16, which turns the last-ulp differences of a padded,
    2560-row batch into other bf16 roundings: prefilled beside 15 other HumanEval prompts, the first's
    logits moved by 0.125, and 3 of the 16 ended with other tokens than each alone. A server batches
    prompts as they arrive, so under q4 each prompt prefills alone: the same bits whatever the batch."""
    from specpool.bench.workloads import load_workload

    _, tokenizer = real_model
    prompts = load_workload("humaneval", tokenizer, 16)

    def prefill(rows: list[list[int]]):
        cache = q4_model.new_cache(len(rows), max(map(len, rows)))
        slots = [cache.allocate() for _ in rows]
        logits, hidden = q4_model.forward(cache, slots, rows, all_logits=True, features=True, prefill=True)
        return logits, hidden, cache

    together, hidden, cache = prefill(prompts)
    for b, p in enumerate(prompts):
        alone, alone_hidden, alone_cache = prefill([p])
        n = len(p)
        assert torch.equal(together[b, :n], alone[0]), f"prompt {b}"
        assert torch.equal(hidden[b, :n], alone_hidden[0])
        assert cache.lengths[b] == n and torch.equal(cache.k[:, b, :, :n], alone_cache.k[:, 0, :, :n])


def _k_blocks(kind, rows: int, cols: int, rng) -> QuantizedBlocks:
    """Random valid blocks of a K-quant (gguf-py quantizes neither), small fp16 super-block scales."""
    size, scales = {Q4_K: (144, (0, 2)), Q6_K: (210, (208,))}[kind]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in scales:
        raw[:, at : at + 2] = rng.uniform(1e-5, 1e-4, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return QuantizedBlocks(kind, (rows, cols), raw.reshape(rows, -1))


Q5_0, Q4_K, Q6_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_a_k_quant_model_runs_on_its_blocks_with_no_dense_copy(qkv_bias):
    """A Q4_K_M-like model (q and k Q4_K, v Q6_K, the output Q5_0, gate and up Q4_K, down Q6_K, the embedding
    Q6_K), of the Llama family and of Qwen2's (q/k/v biases): every matrix on its blocks, prefill too, and the
    embedding looked up by rows; decode and verify steps run the fused layers, the stack of q, k (Q4_K) and v
    (Q6_K) and the biases included; its rows pass the start-up check, and greedy speculation equals its AR
    decoding."""
    import dataclasses

    from specpool.engine.runtime.gguf_loader import GGUFWeights
    from specpool.engine.runtime.linear import BlockEmbedding, StackedBlockLinear

    config = dataclasses.replace(tiny_config(vocab_size=64, d_model=256), qkv_bias=qkv_bias)
    dense = random_weights(config, seed=5)
    rng = np.random.default_rng(5)
    kinds = {"wq": Q4_K, "wk": Q4_K, "wv": Q6_K, "wo": Q5_0, "w_gate": Q4_K, "w_up": Q4_K, "w_down": Q6_K}
    blocks = {"embed": _k_blocks(Q6_K, 64, 256, rng)}
    for name, t in dense.items():
        kind = kinds.get(name.rsplit(".", 1)[-1])
        if kind == Q5_0:
            blocks[name] = QuantizedBlocks(kind, tuple(t.shape), quantize(t.numpy(), kind))
        elif kind is not None:
            blocks[name] = _k_blocks(kind, *t.shape, rng)
    weights = GGUFWeights({k: v for k, v in dense.items() if k not in blocks}, blocks)
    model = Llama(config, weights, "q4", "cpu", blocks=blocks)
    assert model.format.own_kernels and "bit-identical" in model.format_check and model.fused
    layer = model.layers[0]
    assert isinstance(layer["wqkv"], StackedBlockLinear) and isinstance(model.embed, BlockEmbedding)
    assert all(isinstance(layer[k], BlockLinear) and layer[k].prefill is layer[k] for k in ("wo", "w_gate_up", "w_down"))
    prompt = [1, 5, 9, 13, 17, 21, 25, 29]
    ar = generate(model, [prompt], SamplingParams(), 12, stop_ids=[])[0].token_ids
    from specpool.engine.drafters.ngram import NgramDrafter

    assert generate(model, [prompt], SamplingParams(), 12, NgramDrafter(), 3, stop_ids=[])[0].token_ids == ar


def test_a_block_files_fingerprint_is_the_digest_of_its_dense_weights():
    """The fingerprint samples a block matrix from the blocks its values sit in (the same digest as dequantizing it
    whole)."""
    from specpool.engine.runtime.gguf_loader import GGUFWeights
    from specpool.engine.runtime.model import weights_fingerprint

    config = tiny_config(vocab_size=64, d_model=256)
    dense = random_weights(config, seed=7)
    rng = np.random.default_rng(7)
    blocks = {"embed": _k_blocks(Q6_K, 64, 256, rng), "layers.0.wq": _k_blocks(Q4_K, *dense["layers.0.wq"].shape, rng),
              "layers.0.wo": QuantizedBlocks(Q5_0, tuple(dense["layers.0.wo"].shape),
                                             quantize(dense["layers.0.wo"].numpy(), Q5_0))}
    weights = GGUFWeights({k: v for k, v in dense.items() if k not in blocks}, blocks)
    assert weights_fingerprint(config, weights) == weights_fingerprint(config, dict(weights.items()))
