"""The one dtype rule (engine/runtime/device.py): bf16 only where the device computes it natively."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from specpool.engine.runtime.device import cpu_class, native_bf16, resolve_dtype
from specpool.engine.runtime.process_env import NO_NATIVE_BF16


def test_auto_is_fp32_on_cpu_and_names_are_checked():
    assert resolve_dtype("auto", "cpu") == resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype("fp32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="fp32, bf16, auto"):
        resolve_dtype("fp16", "cpu")


def test_bf16_without_native_support_falls_back_to_fp32_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv(NO_NATIVE_BF16, "1")
    assert not native_bf16("cpu") and cpu_class()["native_bf16"] is False
    with caplog.at_level(logging.WARNING, logger="specpool.engine.runtime.device"):
        assert resolve_dtype("bf16", "cpu") == torch.float32
        assert resolve_dtype(torch.bfloat16, "cpu") == torch.float32
    assert len([r for r in caplog.records if "using fp32" in r.message]) <= 1  # once per process


def test_bf16_is_kept_where_native(monkeypatch):
    monkeypatch.delenv(NO_NATIVE_BF16, raising=False)
    expected = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert resolve_dtype("bf16", "cpu") == expected


PROBE = """
import specpool  # first, as in every specpool process: engine/runtime/process_env.py, before torch loads
import json, torch
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.device import cpu_class
from specpool.engine.runtime.model import Llama
m = Llama.random_init(tiny_config(vocab_size=64), dtype=torch.bfloat16)
cache = m.new_cache(1, 16)
m.forward(cache, [cache.allocate()], [[1, 2, 3]])
print(json.dumps(cpu_class() | {"dtype": str(m.dtype), "mkldnn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported()}))
"""


def test_the_override_makes_a_process_run_as_an_avx2_machine():
    """In a fresh process (the way servers start), the override limits oneDNN and ATen to AVX2: oneDNN
    itself then refuses bf16, as on an AVX2 CPU, and a bf16 request loads and runs in fp32."""
    env = {**os.environ, NO_NATIVE_BF16: "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cpu_capability"] in ("AVX2", "DEFAULT") and got["mkldnn_bf16"] is False
    assert got["native_bf16"] is False and got["bf16_override"] is True and got["onednn_max_cpu_isa"] == "AVX2"
    assert got["dtype"] == "torch.float32"
