"""AR decoding at batch 1: specpool's engine in each weight format (q4: the GGUF's own 4-bit blocks
through the int4 kernel; fp32; bf16 where native) against transformers' generate and llama.cpp (where
llama-cpp-python is installed: `make bench-deps`), side by side in one run.

Every engine decodes the same chat-templated prompt for the same number of tokens (stop tokens
ignored), in interleaved repetitions, so machine noise hits all of them alike; medians are reported.
The bandwidth floor is the bytes of weights one decode step reads (as each format holds them)
divided by the streaming-read bandwidth measured in the same run. Each specpool format is also
compared with specpool's fp32 path (the GGUF dequantized): its logits' largest difference over the
prompt and the fp32 path's greedy tokens, and whether its greedy tokens are the same (else where
they first differ, and the fp32 path's top-2 logit gap there). Last, the verify-step cost tables
T(1, K) and T(16, K) for K drafts, the costs the speculation policy plans with
(engine/policy/costs.py), and llama.cpp's own T(1, K) for the same feeds. Each engine's start is
timed: loading the model (q4: repacking its blocks), and the engine's CPU kernels' build or load
(engine/runtime/kernels.py: a build the first time on a machine, a load after).

    python -m specpool.bench.ar_speed --tokens 128 --repeats 3 --json bench/results/ar_speed.json
    SPECPOOL_NO_NATIVE_BF16=1 python -m specpool.bench.ar_speed ...   # the AVX2 class, fresh process
    python -m specpool.bench.ar_speed --model qwen2.5-coder-1.5b --threads 1,2 --tokens 64 \
        --json bench/results/ar_speed_qwen2.5-coder-1.5b.json          # a larger file (issue 50)

A file over --dense-max-mb (`--model`) runs only the default format (auto: q4 on its blocks here) beside
llama.cpp on the same file: its dense fp32/bf16 copies and transformers' (which dequantizes the whole file)
would take minutes and gigabytes and say nothing about the default path; the JSON records why they are
absent. Each thread count of --threads is run in the same process, interleaved with the others. The
specpool process's peak RSS (VmHWM) is read after its model loaded and decoded once, before llama.cpp
or transformers load anything, and compared with the file's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specpool.bench import llamacpp_build
from specpool.common.machine import machine_info, machine_line, memory_read_gbps
from specpool.common.model_args import MODEL_HELP, model_arg
from specpool.engine.decoding import generate
from specpool.engine.policy.costs import measure_step_costs
from specpool.engine.runtime import kernels
from specpool.engine.runtime.device import DTYPES, int4_kernels, kernel_isa, native_bf16
from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.tokenizer import Tokenizer
from specpool.engine.verification.sampling import SamplingParams

try:
    from specpool.bench.llamacpp_peer import LlamaCpp
except ImportError:
    LlamaCpp = None

PROMPT = "Write a Python function that returns the factorial of n."


def process_memory() -> dict[str, int]:
    """This process's resident set now and at its peak (VmRSS, VmHWM), in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def weight_bytes(model: Llama) -> int:
    """Bytes one decode step streams: every layer matrix plus the LM head, as the model holds them
    (norms and the one embedding row are negligible)."""
    matrices = [model.lm_head] + [layer[k] for layer in model.layers for k in ("wqkv", "wo", "w_gate_up", "w_down")]
    return sum(m.nbytes for m in matrices)


def file_matrix_bytes(gguf) -> int:
    """Bytes of the file's own layer matrices and LM head (its blocks as stored): what llama.cpp reads."""
    names = ["embed" if gguf.config.tie_embeddings else "lm_head"] + [
        n for n in gguf.blocks if n.startswith("layers.") and n.rsplit(".", 1)[-1] in
        ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    return sum(gguf.blocks[n].data.nbytes for n in names)


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
    ap.add_argument("--model", type=model_arg, default=None, help=MODEL_HELP)
    ap.add_argument("--threads", default=None,
                    help="CPU thread counts, comma-separated (e.g. 1,2), each run in turn (None: all cores)")
    ap.add_argument("--dense-max-mb", type=float, default=250,
                    help="a file larger than this runs only the default format beside llama.cpp")
    ap.add_argument("--draft-lens", default="0,1,2,4,8",
                    help="K of the verify-step cost table T(1, K) (empty: no table)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap


def logits_along(model: Llama, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] fp32 logits of every position, one forward."""
    cache = model.new_cache(1, len(tokens))
    return model.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]


def against_fp32(model: Llama, fp32: Llama, prompt: list[int], fp32_out: list[int], out: list[int]) -> dict:
    """How far a format's numerics are from the fp32 path: the largest logit difference over the prompt
    and the fp32 path's greedy continuation, and where its greedy tokens first differ, with the fp32
    path's top-2 gap there (a near-tie: either token is the model's)."""
    tokens = prompt + fp32_out[:-1]
    ref = logits_along(fp32, tokens)
    diff = (logits_along(model, tokens) - ref).abs()
    row = {"logits_max_abs_diff_vs_fp32": round(diff.max().item(), 4),
           "logits_mean_abs_diff_vs_fp32": round(diff.mean().item(), 5),
           "same_tokens_as_fp32": out == fp32_out}
    if out != fp32_out:
        i = next(j for j, (a, b) in enumerate(zip(fp32_out, out)) if a != b)
        at = ref[len(prompt) - 1 + i]
        row |= {"first_divergence": i, "fp32_top2_gap_there": round(float(at[fp32_out[i]] - at[out[i]]), 4)}
    return row


def main() -> None:
    args = build_parser().parse_args()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    torch.set_num_threads(threads[0])

    before_load = process_memory()["VmRSS"]  # the interpreter, torch and the engine's modules
    print(machine_line())
    path = Path(args.model) if args.model else default_model_path()
    file_bytes = path.stat().st_size
    large = file_bytes > args.dense_max_mb * 1e6
    started = time.perf_counter()
    gguf = load_gguf(path)
    tokenizer = Tokenizer.from_gguf(gguf)
    open_s = time.perf_counter() - started
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    eos = gguf.config.eos_id
    skipped = {}
    # bf16 only where this CPU computes it natively: elsewhere it would run ~60x slower (or load as fp32).
    dtypes = ("fp32", "bf16") if native_bf16("cpu") else ("fp32",)
    if len(dtypes) == 1:
        print(f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16: fp32 dense engines only")
    started = time.perf_counter()
    own_kernels = kernels.available()
    kernels_s = time.perf_counter() - started
    print(f"engine CPU kernels ({kernel_isa()}): " + (f"ready in {kernels_s:.1f} s" if own_kernels else "none"))
    if large:
        why = (f"file {file_bytes / 1e6:.0f} MB > --dense-max-mb {args.dense_max_mb:.0f}: only the default "
               "format (auto) runs beside llama.cpp")
        skipped = {"specpool-fp32": why, "specpool-bf16": why, "transformers-fp32": why, "transformers-bf16": why}
        print(why)
        formats, dtypes = ("auto",), ()
    else:
        formats = (("q4",) if own_kernels or int4_kernels("cpu") else ()) + dtypes
    engines, models, load_s = {}, {}, {}
    for fmt in formats:
        started = time.perf_counter()
        model = models[fmt] = Llama(gguf.config, gguf.weights, fmt, "cpu", blocks=gguf.blocks)
        load_s[fmt] = time.perf_counter() - started

        def ours(model=model):
            [r] = generate(model, [prompt_ids], SamplingParams(), args.tokens, stop_ids=[])
            return r.token_ids, len(r.token_ids) / (r.prefill_s + r.decode_s)

        engines[f"specpool-{fmt}"] = (ours, weight_bytes(model))
    for fn, _ in engines.values():  # warm-up, and the specpool process's peak before any peer loads
        fn()
    memory = process_memory()
    print(f"specpool: peak RSS {memory['VmHWM'] / 1e9:.2f} GB ({memory['VmHWM'] / file_bytes:.2f}x the "
          f"{file_bytes / 1e9:.2f} GB file), resident {memory['VmRSS'] / 1e9:.2f} GB")
    llms = {}
    if LlamaCpp is None:
        print("llama-cpp-python is not installed (make bench-deps): no llama.cpp row")
    else:
        llms = {t: LlamaCpp(path, t, sequences=1) for t in threads}

        def llamacpp():
            run = llms[torch.get_num_threads()].generate([prompt_ids], args.tokens, stop=False)
            return run.token_ids[0], run.tokens_per_s

        engines["llamacpp"] = (llamacpp, file_matrix_bytes(gguf))
    del gguf

    if dtypes:
        import transformers
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

    gbps = memory_read_gbps()
    for name, (fn, _) in engines.items():  # warm-up: first calls pay one-off allocation costs
        if not name.startswith("specpool-"):  # (those warmed up above)
            fn()
    speeds: dict[tuple[str, int], list[float]] = {(name, t): [] for t in threads for name in engines}
    outputs: dict[tuple[str, int], list[int]] = {}
    for rep in range(args.repeats):
        for t in threads:
            torch.set_num_threads(t)
            for name, (fn, _) in engines.items():
                outputs[name, t], tps = fn()
                speeds[name, t].append(tps)
        print(f"repeat {rep + 1}/{args.repeats}: "
              + ", ".join(f"{n} {t}t {s[-1]:.1f}" for (n, t), s in speeds.items()))
    gbps = max(gbps, memory_read_gbps())  # the better of two probes: before and after the timed runs

    rows = []
    for t in threads:
        base = statistics.median(speeds["transformers-fp32", t]) if "transformers-fp32" in engines else None
        ours_fp32 = statistics.median(speeds["specpool-fp32", t]) if "specpool-fp32" in engines else None
        llamacpp_tps = statistics.median(speeds["llamacpp", t]) if llms else None
        for name, (_, nbytes) in engines.items():
            tps = statistics.median(speeds[name, t])
            row = {
                "engine": name,
                "threads": t,
                "tokens_per_s": round(tps, 2),
                "tokens_per_s_repeats": [round(x, 2) for x in speeds[name, t]],
                "time_per_output_token_s": round(1 / tps, 5),
            }
            if base:
                row |= {"speedup_vs_transformers_fp32": round(tps / base, 3),
                        "outputs_match_transformers_fp32": until_stop(outputs[name, t], eos)
                        == outputs["transformers-fp32", t][: len(until_stop(outputs[name, t], eos))]}
            if llamacpp_tps:
                row["speedup_vs_llamacpp"] = round(tps / llamacpp_tps, 3)
                if name != "llamacpp":
                    row["same_tokens_as_llamacpp"] = outputs[name, t] == outputs["llamacpp", t]
            if nbytes:
                floor = nbytes / (gbps * 1e9)
                row |= {"weight_bytes_per_token": nbytes, "bandwidth_floor_s": round(floor, 5),
                        "times_floor": round(1 / tps / floor, 2)}
                if ours_fp32:
                    row["speedup_vs_specpool_fp32"] = round(tps / ours_fp32, 3)
                fmt = name.removeprefix("specpool-")
                if fmt in load_s:
                    model = models[fmt]
                    row["load_s"] = round(load_s[fmt], 2)
                    row["format"] = model.format_label
                    row["path"] = ("fused kernels" if model.fused else "torch int4") if model.format.int4 else "oneDNN"
                    if fmt not in ("fp32", "llamacpp") and "fp32" in models:
                        row |= against_fp32(model, models["fp32"], prompt_ids, outputs["specpool-fp32", t],
                                            outputs[name, t])
            rows.append(row)

    lens = [int(k) for k in args.draft_lens.split(",") if k.strip()]
    batches = (1,) if large else (1, 16)
    step_costs, step_costs_16 = {}, {}
    if lens:
        for t in threads:
            torch.set_num_threads(t)
            for fmt, model in models.items():  # interleaved within each table (measure_step_costs), not across
                costs = measure_step_costs(model, batches, tuple(lens), repeats=5)
                step_costs[f"specpool-{fmt}", t] = costs.seconds[0]
                if len(batches) > 1:
                    step_costs_16[f"specpool-{fmt}", t] = costs.seconds[1]
            if llms:
                step_costs["llamacpp", t] = llms[t].step_costs(lens)

        def table(costs: dict) -> dict:
            out = {}
            for (name, t), seconds in costs.items():
                out[f"{name}@{t}t" if len(threads) > 1 else name] = {
                    "threads": t,
                    "ms": {k: round(s * 1e3, 2) for k, s in zip(lens, seconds)},
                    "vs_k0": {k: round(s / seconds[0], 3) for k, s in zip(lens, seconds)}}
            return out

        step_costs, step_costs_16 = table(step_costs), table(step_costs_16)
    if large:
        skipped["verify_step_costs_batch16"] = "batch 16 not measured for a file over --dense-max-mb"

    report = {
        "command": "python -m specpool.bench.ar_speed " + " ".join(sys.argv[1:]),
        "machine": machine_info() | {"memory_read_gbps": round(gbps, 1), "threads_run": threads},
        "llamacpp_build": llamacpp_build.installed() if llms else None,  # its ISA flags (bench/llamacpp_build.py)
        "model": path.name,
        "file_bytes": file_bytes,
        "prompt": PROMPT,
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "kernels": {"isa": kernel_isa(), "available": own_kernels, "ready_s": round(kernels_s, 2)},
        # load: opening the file and its tokenizer, then building each format (q4: repacking its blocks)
        "start": {"open_s": round(open_s, 2)} | {
            f"specpool-{fmt}_load_s": round(open_s + s, 2) for fmt, s in load_s.items()},
        "specpool_memory": {"rss_before_load_bytes": before_load,
                            "peak_rss_bytes": memory["VmHWM"], "rss_bytes": memory["VmRSS"],
                            "peak_rss_over_file": round(memory["VmHWM"] / file_bytes, 3),
                            "when": "after loading and one decode of every specpool format, before any peer"},
        "skipped": skipped,
        "results": rows,
        "verify_step_costs_batch1": step_costs,
        "verify_step_costs_batch16": step_costs_16,
    }
    print(f"\nAR batch 1, {args.tokens} new tokens, median of {args.repeats} (memory read {gbps:.1f} GB/s)")
    print(f"{'engine':<20} {'thr':>3} {'tok/s':>7} {'ms/tok':>7} {'vs hf-fp32':>10} {'vs fp32':>8} {'vs llcpp':>8} "
          f"{'MB/tok':>7} {'x floor':>8} {'same as hf':>10}  vs specpool-fp32")
    for r in rows:
        versus = ""
        if "logits_max_abs_diff_vs_fp32" in r:
            versus = f"logits max |diff| {r['logits_max_abs_diff_vs_fp32']:.3f}, greedy " + (
                "same" if r["same_tokens_as_fp32"] else
                f"differs at token {r['first_divergence']} (fp32 top-2 gap {r['fp32_top2_gap_there']:.4f})")
        print(f"{r['engine']:<20} {r['threads']:>3} {r['tokens_per_s']:>7.1f} {1e3 * r['time_per_output_token_s']:>7.1f} "
              f"{r.get('speedup_vs_transformers_fp32', float('nan')):>9.2f}x "
              f"{r.get('speedup_vs_specpool_fp32', float('nan')):>7.2f}x "
              f"{r.get('speedup_vs_llamacpp', float('nan')):>7.2f}x "
              f"{r.get('weight_bytes_per_token', float('nan')) / 1e6:>7.0f} {r.get('times_floor', float('nan')):>8.1f} "
              f"{r.get('outputs_match_transformers_fp32', '-')!s:>10}  {versus}")
    for batch, costs in ((1, step_costs), (16, step_costs_16)):
        if not costs:
            continue
        print(f"\nverify step T({batch}, K), batch {batch}, K drafts (ms; ratio to K=0), best of 5")
        print(f"{'engine':<20} " + " ".join(f"{'K=' + str(k):>14}" for k in lens))
        for name, t in costs.items():
            print(f"{name:<20} " + " ".join(f"{t['ms'][k]:>7.1f} ({t['vs_k0'][k]:.2f})" for k in lens))
    print(f"\nstart: open {open_s:.1f} s, " + ", ".join(f"specpool-{fmt} build {s:.1f} s" for fmt, s in load_s.items())
          + f", kernels {kernels_s:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
