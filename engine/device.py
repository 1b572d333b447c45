"""The one place that chooses device, weight dtype and torch.distributed backend (and keeps
CPU thread pools from multiplying)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto": bf16 on GPU; fp32 on CPU, where greedy output must match the fp32 oracle.

    bf16 on CPU is selectable (`--dtype bf16`): it halves the bytes each decode step reads.
    """
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of fp32, bf16, auto; got {name!r}")
    return table[name]


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def off_main_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that exits when it returns; its result, or its exception re-raised.

    OpenMP keeps a pool of worker threads per thread that ran a parallel region, for as long as
    that thread lives. A server that loaded its model on the main thread and decoded on another
    kept two pools, and AR decoding on the second thread measured ~20% slower than with the
    model loaded on a thread that had exited. Servers do their heavy setup here so that the
    decode thread's pool is the only one.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="setup") as pool:
        return pool.submit(fn).result()
