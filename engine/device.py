"""The one place that chooses device, weight dtype and torch.distributed backend (and keeps
CPU thread pools from multiplying)."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
    that thread lives. A server that loads its model on the main thread and decodes on another
    keeps two pools, more threads than cores, and libgomp then naps between regions instead of
    spinning: AR decoding on the second thread measured ~20% slower. Servers do their heavy setup
    here so that the decode thread's pool is the only one.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="setup")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
