"""Prove the GPU path in minutes: correctness first, then AR / SD / SSD speed on the device.

    python -m specpool.bench.gpu_check --json bench/results/gpu_check.json   # on a machine with a GPU
    python -m specpool.bench.gpu_check --dry-run                              # anywhere: CPU, a few tokens

In order; a failed check ends the run with exit code 1:
1. greedy: the device path's tokens on the reference prompt equal the CPU fp32 path's, or the first
   divergence is reported with the device's top-2 logit gap there (bf16 may flip a near tie: a gap
   above --max-flip-gap fails);
2. lossless sampling on the device: speculative sampling (verify_dense) on a small vocabulary, many
   rows at once: the first emitted token's distribution equals the target's within a total-variation
   bound, and the same check fails a biased twin (q misreported), so it can tell;
3. speed at batch 1 on HumanEval prompts: AR, SD (the draft model, K drafts) and SSD, tokens/s and
   tokens per target step, each equal to AR's tokens (greedy).
The device, dtype (engine/runtime/device.py's choice: bf16 where native), attention (SDPA) and the tensor
channel's backend (NCCL on CUDA) are recorded with the figures. The dry run is the same code on the CPU
in fp32 with few prompts and tokens: the suite runs it, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specpool.common.machine import machine_info
from specpool.engine.decoding import generate
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.ssd import SsdDrafter
from specpool.engine.runtime.device import default_device, distributed_backend
from specpool.engine.runtime.gguf_loader import default_model_path
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.rules import verify_dense
from specpool.engine.verification.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that returns the factorial of n."
DRAFT_DIR = REPO / "models" / "smollm2-135m-draft"
TV_VOCAB, TV_DRAFTS = 16, 4


def check_greedy(model: Llama, tokenizer, tokens: int, max_flip_gap: float) -> dict:
    """The device's greedy tokens against the CPU fp32 path's (the reference)."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    reference, _ = Llama.from_gguf(default_model_path(), dtype="fp32", device="cpu")
    want = generate(reference, [prompt], SamplingParams(), tokens, stop_ids=[])[0].token_ids
    got = generate(model, [prompt], SamplingParams(), tokens, stop_ids=[])[0].token_ids
    out = {"tokens": tokens, "equal": got == want}
    if got != want:
        at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        context = prompt + want[:at]
        cache = model.new_cache(1, len(context))
        logits = model.forward(cache, [cache.allocate()], [context])[0]  # [V], fp32
        top2 = logits.topk(2).values
        out.update(first_divergence=at, top2_gap=float(top2[0] - top2[1]))
        out["ok"] = out["top2_gap"] <= max_flip_gap
    else:
        out["ok"] = True
    return out


def tv_of_first_token(device: torch.device, rows: int, misreport_q: bool, seed: int = 0) -> float:
    """Total variation between the first emitted token's distribution under speculative sampling and
    the target's own. misreport_q: verification is told a q other than the one the drafts came from."""
    g = torch.Generator(device=device).manual_seed(seed)
    p = torch.softmax(torch.randn(TV_DRAFTS + 1, TV_VOCAB, generator=g, device=device) * 1.5, -1)
    q = torch.softmax(torch.randn(TV_DRAFTS, TV_VOCAB, generator=g, device=device) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=g) for i in range(TV_DRAFTS)], 1)
    told = torch.full_like(q, 1.0 / TV_VOCAB) if misreport_q else q
    result = verify_dense(drafts, told.expand(rows, -1, -1), p.expand(rows, -1, -1),
                          torch.full((rows,), TV_DRAFTS, device=device), g)
    first = torch.where(result.accepted > 0, drafts[:, 0], result.next_token)
    seen = torch.bincount(first, minlength=TV_VOCAB).float() / rows
    return 0.5 * float((seen - p[0]).abs().sum())


def check_sampling(device: torch.device, rows: int) -> dict:
    # Sampling noise alone: E[TV] ~ 0.5 * V * sqrt(2 / pi) * sqrt((1/V) / rows); the bound is 3x that.
    bound = 3 * 0.5 * TV_VOCAB * (2 / torch.pi) ** 0.5 * (1 / (TV_VOCAB * rows)) ** 0.5
    tv, twin = tv_of_first_token(device, rows, False), tv_of_first_token(device, rows, True)
    return {"rows": rows, "vocab": TV_VOCAB, "tv": tv, "biased_twin_tv": twin, "bound": bound,
            "ok": tv < bound < twin}


def _timed(model: Llama, prompts, tokens: int, make_drafter=None, k: int = 0) -> tuple[list, float]:
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    results = []
    for prompt in prompts:
        drafter = make_drafter() if make_drafter else None
        results += generate(model, [prompt], SamplingParams(), tokens, drafter=drafter, num_draft_tokens=k,
                            stop_ids=[])
    sync()
    return results, time.perf_counter() - start


def measure_speed(model: Llama, tokenizer, prompts: int, tokens: int, k: int, dtype: str) -> dict:
    from specpool.bench.workloads import load_workload

    work = load_workload("humaneval", tokenizer, limit=prompts)
    draft = Llama.from_draft_checkpoint(DRAFT_DIR, model.embed.float().cpu(), dtype, str(model.device))
    max_len = max(map(len, work)) + tokens + k + 2
    _timed(model, work[:1], 4)  # warm-up: kernels chosen, caches allocated
    ar, ar_s = _timed(model, work, tokens)
    rows = {"ar": (ar, ar_s)}
    rows[f"sd:{k}"] = _timed(model, work, tokens, lambda: ModelDrafter(draft, 1, max_len), k)
    rows[f"ssd:{k}"] = _timed(model, work, tokens, lambda: SsdDrafter(draft, 1, max_len), k)
    out = {}
    for mode, (results, seconds) in rows.items():
        emitted = sum(len(r.token_ids) for r in results)
        out[mode] = {"tokens_per_s": emitted / seconds, "vs_ar": ar_s / seconds,
                     "tokens_per_step": sum(r.mean_accept_len for r in results) / len(results),
                     "equal_to_ar": [r.token_ids for r in results] == [r.token_ids for r in ar]}
    out["ok"] = all(row["equal_to_ar"] for row in out.values())
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, a few prompts and tokens: checks the script")
    p.add_argument("--prompts", type=int, default=10, help="HumanEval prompts for the speed table")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--draft-tokens", type=int, default=4, help="K: drafts per round for sd and ssd")
    p.add_argument("--tv-rows", type=int, default=1_000_000, help="rows of the sampling check")
    p.add_argument("--max-flip-gap", type=float, default=0.5,
                   help="a greedy divergence from the CPU fp32 path passes only at a top-2 logit gap this small")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cpu") if args.dry_run else default_device()
    if args.dry_run:
        args.prompts, args.tokens, args.tv_rows = 1, 8, 20_000
    dtype = "fp32" if args.dry_run else "auto"
    model, tokenizer = Llama.from_gguf(default_model_path(), dtype=dtype, device=str(device))
    report = {
        "command": " ".join(["python -m specpool.bench.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(), "device": str(device), "dtype": str(model.dtype),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "attention": "torch.nn.functional.scaled_dot_product_attention",
        "tensor_channel_backend": distributed_backend(device),
    }
    report["greedy"] = check_greedy(model, tokenizer, args.tokens, args.max_flip_gap)
    print("greedy vs the CPU fp32 path:", report["greedy"], flush=True)
    report["sampling"] = check_sampling(device, args.tv_rows)
    print("speculative sampling on the device:", report["sampling"], flush=True)
    report["speed"] = measure_speed(model, tokenizer, args.prompts, args.tokens, args.draft_tokens, dtype)
    for mode, row in report["speed"].items():
        if mode != "ok":
            print(f"{mode:8s} {row['tokens_per_s']:8.1f} tokens/s  {row['vs_ar']:.2f}x AR  "
                  f"{row['tokens_per_step']:.2f} tokens/step  equal to AR: {row['equal_to_ar']}", flush=True)
    report["ok"] = all(report[part]["ok"] for part in ("greedy", "sampling", "speed"))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print("all checks passed" if report["ok"] else "a check FAILED", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
