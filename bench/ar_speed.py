"""AR decoding at batch 1: specpool's engine against transformers' generate, side by side in one run.

Every engine decodes the same chat-templated prompt for the same number of tokens (stop tokens
ignored), in interleaved repetitions, so machine noise hits all of them alike; medians are reported.
The bandwidth floor is the bytes of weights one decode step must read divided by the measured
streaming-read bandwidth of this machine.

    python -m specpool.bench.ar_speed --tokens 128 --repeats 3 --json bench/results/ar_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specpool.common.machine import machine_info, memory_read_gbps
from specpool.engine.decoding import generate
from specpool.engine.device import DTYPES, native_bf16
from specpool.engine.gguf_loader import default_model_path
from specpool.engine.model import Llama
from specpool.engine.sampling import SamplingParams

PROMPT = "Write a Python function that returns the factorial of n."


def weight_bytes(model: Llama) -> int:
    """Bytes one decode step streams: every layer matrix plus the LM head (norms are negligible)."""
    c = model.config
    per_layer = c.d_model * (c.d_model + 2 * c.kv_dim) + c.d_model * c.d_model + 3 * c.d_model * c.ffn_dim
    elements = c.n_layers * per_layer + c.vocab_size * c.d_model
    return elements * torch.finfo(model.dtype).bits // 8


def until_stop(tokens: list[int], stop: int) -> list[int]:
    """Tokens before the first stop token: from there on transformers' min_new_tokens masks the
    stop token while we keep decoding freely, so later tokens are not comparable."""
    return tokens[: tokens.index(stop)] if stop in tokens else tokens


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written (its command example keeps its lines), and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens each engine decodes per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; medians are reported")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: all cores)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    path = default_model_path()
    engines = {}
    prompt_ids = None
    # bf16 only where this CPU computes it natively: elsewhere it would run ~60x slower (or load as fp32).
    dtypes = ("fp32", "bf16") if native_bf16("cpu") else ("fp32",)
    if len(dtypes) == 1:
        print(f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16: fp32 engines only")
    for dtype in dtypes:
        model, tokenizer = Llama.from_gguf(path, dtype=dtype, device="cpu")
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        eos = model.config.eos_id

        def ours(model=model, prompt_ids=prompt_ids):
            [r] = generate(model, [prompt_ids], SamplingParams(), args.tokens, stop_ids=[])
            return r.token_ids, len(r.token_ids) / (r.prefill_s + r.decode_s)

        engines[f"specpool-{dtype}"] = (ours, weight_bytes(model))

    for dtype in (DTYPES[d] for d in dtypes):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        hf.eval()

        def theirs(hf=hf):
            ids = torch.tensor([prompt_ids])
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            elapsed = time.perf_counter() - start
            new = out[0, ids.shape[1] :].tolist()
            return new, len(new) / elapsed

        engines[f"transformers-{'fp32' if dtype == torch.float32 else 'bf16'}"] = (theirs, None)

    for fn, _ in engines.values():  # warm-up: first calls pay one-off allocation costs
        fn()
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for rep in range(args.repeats):
        for name, (fn, _) in engines.items():
            outputs[name], tps = fn()
            speeds[name].append(tps)
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{n} {s[-1]:.1f}" for n, s in speeds.items()))

    gbps = memory_read_gbps()
    base = statistics.median(speeds["transformers-fp32"])
    rows = []
    for name, (_, nbytes) in engines.items():
        tps = statistics.median(speeds[name])
        row = {
            "engine": name,
            "tokens_per_s": round(tps, 2),
            "time_per_output_token_s": round(1 / tps, 5),
            "speedup_vs_transformers_fp32": round(tps / base, 3),
            "outputs_match_transformers_fp32": until_stop(outputs[name], eos)
            == outputs["transformers-fp32"][: len(until_stop(outputs[name], eos))],
        }
        if nbytes:
            floor = nbytes / (gbps * 1e9)
            row |= {"bandwidth_floor_s": round(floor, 5), "times_floor": round(1 / tps / floor, 2)}
        rows.append(row)

    report = {
        "machine": machine_info() | {"memory_read_gbps": round(gbps, 1)},
        "model": path.name,
        "prompt": PROMPT,
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "results": rows,
    }
    print(f"\nAR batch 1, {args.tokens} new tokens, median of {args.repeats} (memory read {gbps:.1f} GB/s)")
    print(f"{'engine':<20} {'tok/s':>7} {'ms/tok':>7} {'vs hf-fp32':>10} {'x floor':>8} {'same tokens':>12}")
    for r in rows:
        print(f"{r['engine']:<20} {r['tokens_per_s']:>7.1f} {1e3 * r['time_per_output_token_s']:>7.1f} "
              f"{r['speedup_vs_transformers_fp32']:>9.2f}x {r.get('times_floor', float('nan')):>8.1f} "
              f"{r['outputs_match_transformers_fp32']!s:>12}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
