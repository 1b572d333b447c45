"""Every model is checked as it loads (engine/runtime/row_check.py): a format whose decode, verify, tree and
batch rows are not the same bits on this CPU falls back to the next one, with one log line naming why, and
speculation through what it picked equals its own AR.

Issue 53: on an Intel Xeon VM with AMX, torch's int4 path (where the engine's kernels cannot be built) kept
its LM head dense in bf16, and oneDNN ran more than 32 rows of it through other AMX blocking than one row:
logits up to 0.125 apart between a batch's verify rows and decode rows. The twins below make a matrix of
either kind depend on its row count in the same way on any CPU, so the fallback is tested on every class."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from specpool.engine.decoding import generate
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.runtime import kernels, linear
from specpool.engine.runtime.device import native_bf16
from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

pytestmark = pytest.mark.slow
ROWS_PER_BLOCK = 32  # where oneDNN's AMX kernel switched blocking on that VM


@pytest.fixture(scope="module")
def shipped():
    return load_gguf(default_model_path())


def row_dependent(call):
    """A matrix's product that, past 32 rows, sums its inputs in two halves: other roundings, as a kernel
    that blocks a large step differently. A norm fused into the call (the head's final norm) is applied first,
    as the call would: on an AMD EPYC torch's int4 path left only the head dense, and it is called with one."""

    def twin(self, x, norm=None, eps=0.0):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if rows <= ROWS_PER_BLOCK:
            return call(self, x, norm, eps)
        if norm is not None:
            x = F.rms_norm(x, (x.shape[-1],), norm, eps)
        half = x.shape[-1] // 2
        low, high = torch.zeros_like(x), torch.zeros_like(x)
        low[..., :half], high[..., half:] = x[..., :half], x[..., half:]
        return call(self, low) + call(self, high)

    return twin


def torch_int4_model(shipped, caplog):
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(kernels, "available", lambda: False)  # the path of a machine without a C++ compiler
        return Llama(shipped.config, shipped.weights, "q4", "cpu", blocks=shipped.blocks)


def test_the_int4_path_with_a_bf16_head_whose_rows_differ_runs_its_dense_matrices_in_fp32(shipped, caplog,
                                                                                         monkeypatch):
    if not native_bf16("cpu"):  # named, not passed silently
        pytest.skip("no native bf16 on this CPU class: its dense matrices are fp32 from the start, so there is no "
                    "bf16 to fall back from; test_an_int4_path_whose_rows_differ_runs_as_fp32 covers its fallback")
    original = linear.Linear.__call__
    monkeypatch.setattr(linear.Linear, "__call__",
                        lambda self, x, *a, **k: (row_dependent(original) if self.dtype == torch.bfloat16
                                                  else original)(self, x, *a, **k))
    model = torch_int4_model(shipped, caplog)
    assert model.format.label == "q4 (torch int4, fp32 dense)" and isinstance(model.layers[0]["wqkv"],
                                                                              linear.Int4Linear)
    assert model.format_check == "decode, verify, tree and batch rows bit-identical"
    [line] = [r.getMessage() for r in caplog.records if "so it runs as" in r.getMessage()]
    assert "q4 (torch int4, bf16 dense): a batch of 8 verify rows each (72 rows) differs" in line, line


def test_an_int4_path_whose_rows_differ_runs_as_fp32(shipped, caplog, monkeypatch):
    monkeypatch.setattr(linear.Int4Linear, "__call__", row_dependent(linear.Int4Linear.__call__))
    model = torch_int4_model(shipped, caplog)
    assert model.format.label == "fp32" and not model.format.int4
    assert "so it runs as fp32" in caplog.text


def test_greedy_speculation_through_the_format_auto_picks_equals_its_ar(shipped):
    """On this CPU as it is, for the format `auto` picks with and without the engine's kernels: whatever
    the check kept runs the same tokens through n-gram speculation (K = 2 and 8) as its own AR."""
    for own_kernels in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not own_kernels:
                patch.setattr(kernels, "available", lambda: False)
            model = Llama(shipped.config, shipped.weights, "auto", "cpu", blocks=shipped.blocks)
        if model.format.int4:  # every format auto picks is bit-identical across rows, or it was not kept
            assert model.format_check == "decode, verify, tree and batch rows bit-identical", model.format_label
        prompts = [[1, *range(400, 460)], [1, *range(700, 720), *range(700, 720)]]
        alone = [r.token_ids for r in generate(model, prompts, SamplingParams(), 40, stop_ids=[])]
        for k in (2, 8):
            sped = generate(model, prompts, SamplingParams(), 40, NgramDrafter(), k, stop_ids=[])
            assert [r.token_ids for r in sped] == alone, (model.format_label, k)
            assert sum(r.drafted_tokens for r in sped) > 0, "the n-gram drafter drafted nothing: the path did not run"
