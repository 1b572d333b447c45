"""The cost table T(b, s) of a verify step of b sequences with s drafts each: measured once per model, dtype
and thread count, cached on disk, re-measured when stale."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specpool.engine.runtime.device import cpu_class, kernel_isa
from specpool.engine.runtime.model import Llama

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# 3, 7 and 11 end a block of 4 rows (s + 1 = 4, 8, 12): the int4 kernel's cost steps up after each
# (engine/runtime/linear.py), and interpolating across a step would price s = 7 between two and three blocks.
DRAFT_LENS = (0, 1, 2, 3, 4, 6, 7, 8, 11, 12, 16)
STALE_TABLE = 0.75  # a cached T(1, 0) this much slower than a fresh check is re-measured


def batch_sizes_up_to(max_batch: int) -> tuple[int, ...]:
    """The BATCH_SIZES a decoder of at most max_batch sequences runs at: those under it and the first at or past
    it (two at least, so the table extrapolates). A target of batch 8 measuring the 1.5B Qwen's batches of
    16 and 32 too spent about 3/4 of its first start on cells it never runs."""
    sizes = tuple(b for b in BATCH_SIZES if b < max_batch) + tuple(b for b in BATCH_SIZES if b >= max_batch)[:1]
    return sizes if len(sizes) >= 2 else BATCH_SIZES[:2]


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds of one forward with b sequences feeding s+1 tokens each."""

    batch_sizes: tuple[int, ...]
    draft_lens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [batch size][draft len]

    # Cached: a policy prices every length at every round, and interpolating afresh cost 0.25-0.4 ms a
    # round (2% of a 16 ms batch-1 step). A process holds a few tables for its life: nothing leaks.
    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def __call__(self, batch_size: int, draft_len: int) -> float:
        """Piecewise-linear in both batch size and draft length; linear extrapolation past the table."""
        per_b = [self._along_draft_len(row, draft_len) for row in self.seconds]
        bs = self.batch_sizes
        if batch_size <= bs[-1]:
            return float(np.interp(batch_size, bs, per_b))
        slope = (per_b[-1] - per_b[-2]) / (bs[-1] - bs[-2])
        return per_b[-1] + slope * (batch_size - bs[-1])

    def _along_draft_len(self, row: tuple[float, ...], draft_len: int) -> float:
        lens = self.draft_lens
        if draft_len <= lens[-1]:
            return float(np.interp(draft_len, lens, row))
        # Long feeds (a drafter catching up on a context) are compute-bound: at least the mean
        # per-token cost of the longest measured step, whatever noise says about the local slope.
        slope = max((row[-1] - row[-2]) / (lens[-1] - lens[-2]), row[-1] / (lens[-1] + 1))
        return row[-1] + slope * (draft_len - lens[-1])


def measure_step_costs(
    model: Llama,
    batch_sizes=BATCH_SIZES,
    draft_lens=DRAFT_LENS,
    context_len: int = 128,
    repeats: int = 3,
) -> StepCosts:
    """Time verify steps on a synthetic context: the fastest of `repeats` per cell, made non-decreasing in s."""
    cache = model.new_cache(max(batch_sizes), context_len + max(draft_lens) + 1)
    slots = [cache.allocate() for _ in range(max(batch_sizes))]
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (context_len,), generator=gen).tolist()
    def feed(rows: list[list[int]], **kwargs):
        if model.config.feature_fed:  # a draft head: any features cost the same
            kwargs["fed_features"] = torch.zeros(len(rows), len(rows[0]), model.config.d_model)
        model.forward(cache, slots[: len(rows)], rows, **kwargs)

    feed([context] * len(slots))
    best = {(b, s): float("inf") for b in batch_sizes for s in draft_lens}
    # A batch size's row at a time, as a decoder runs steps of one batch size in a row: a step right after
    # one of many more rows ran slower (the Qwen2.5-Coder 0.5B's 1-row step 10.9 ms after 144-row ones, 8.0
    # among its own; Intel Xeon, 2 cores), which priced a pair's drafts a third too high and its drafts
    # too short. Within a row every cell is timed once per pass, so a slow spell of a shared machine
    # slows all cells alike instead of bending the row's shape; the first pass warms up allocations.
    for b in batch_sizes:
        for rep in range(repeats + 1):
            for s in draft_lens:
                start = time.perf_counter()
                feed([context[: s + 1]] * b, all_logits=True)
                elapsed = time.perf_counter() - start
                for slot in slots[:b]:
                    cache.truncate(slot, context_len)
                if rep:  # the fastest run: on a shared machine the others were interrupted, not slower
                    best[b, s] = min(best[b, s], elapsed)
    table = [tuple(_non_decreasing([best[b, s] for s in draft_lens])) for b in batch_sizes]
    return StepCosts(tuple(batch_sizes), tuple(draft_lens), tuple(table))


def _non_decreasing(row: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): feeding more tokens never costs
    less, so a dip in a measured row is noise and must not make the policy prefer it."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in row:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def cached_step_costs(model: Llama, model_id: str, cache_dir: Path | None = None, **kwargs) -> StepCosts:
    """measure_step_costs, cached on disk per model (its name and its weights' fingerprint: a head retrained
    into the same directory is another model), weight format (q4, fp32 or bf16: a table measured with
    dense weights says nothing about the int4 kernel's), device, thread count and CPU class (a table
    measured with AVX-512 kernels says nothing about the same disk's next machine, an AVX2 one)."""
    path, key = _cache_path(model, model_id, torch.get_num_threads(), cache_dir, kwargs)
    if path.exists():
        costs = _read_costs(path)
        # A table measured while another job loaded the machine is slow throughout and would make
        # speculation look worse than it is, for good: re-measure when a quick check is clearly faster.
        now = measure_step_costs(model, (1,), (0,), kwargs.get("context_len", 128), repeats=3).seconds[0][0]
        if now >= STALE_TABLE * costs(1, 0):
            return costs
        log.info("cached step costs of %s are stale (%.1f ms now vs %.1f ms cached): measuring again",
                 model_id, now * 1e3, costs(1, 0) * 1e3)
    costs = measure_step_costs(model, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(costs) | {"key": key}))
    return costs


def peek_step_costs(model: Llama, model_id: str, threads: int, cache_dir: Path | None = None,
                    **kwargs) -> StepCosts | None:
    """The table cached_step_costs keeps for this model at `threads` threads, read as it is (neither
    measured nor checked for staleness: other threads' tables cannot be checked from this process);
    None when none is cached."""
    path, _ = _cache_path(model, model_id, threads, cache_dir, kwargs)
    return _read_costs(path) if path.exists() else None


def _cache_path(model: Llama, model_id: str, threads: int, cache_dir: Path | None, kwargs: dict) -> tuple[Path, str]:
    fmt = model.format
    key = (f"v7|{model_id}|{model.fingerprint}|{fmt.name}|{model.dtype}|{fmt.dense_dtype}|{model.device}|{threads}"
           f"|{cpu_class()}|{kwargs}")
    if fmt.own_kernels:  # a table measured with an older build of the kernels says little about this one
        from specpool.engine.runtime import kernels

        key += f"|{kernels.build_name(kernel_isa())}"
    cache_dir = cache_dir or Path.home() / ".cache" / "specpool" / "step-costs"
    return cache_dir / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json"), key


def _read_costs(path: Path) -> StepCosts:
    data = json.loads(path.read_text())
    return StepCosts(tuple(data["batch_sizes"]), tuple(data["draft_lens"]), tuple(map(tuple, data["seconds"])))
