"""`specpool bench`: every mode on one workload, side by side in one run.

Modes are interleaved chunk by chunk (each chunk of `batch_size` prompts runs through every
mode before the next chunk, in an order that rotates by one mode per chunk), so noise on this
shared machine falls on all modes alike.
Speedups are against `ar` of the same run, batch size and temperature (hf-* against hf-ar, llamacpp-*
against llamacpp-ar); every row is also compared with llamacpp-ar when it ran (the CPU runtime to beat).

Mode names: ar; sd and ngram (draft length chosen per step by the hardware-aware policy);
sd:K and ngram:K (fixed draft length K); head[:K] (the feature-fed head); sd-tree[:N] and head-tree[:N]
(token trees of N nodes, or of the policy's budget); head-suffix[:N] (trees from a suffix store over the
workload's prompts and outputs where it is sure, else the head's: engine/drafters/hybrid.py); hf-ar, hf-prompt-lookup, hf-assisted (transformers);
llamacpp-ar and llamacpp-lookup[:K] (llama.cpp on the same GGUF, batched as its server batches: bench/llamacpp_peer.py);
llamacpp-sd[:N] (llama.cpp's own draft-model speculation, drafting up to N tokens with --draft's GGUF, batch 1:
bench/llamacpp_spec.py);
the modes through servers in bench/remote.py. routed and routed-http are compared with routed-ar (AR
through the same router and servers) when both run, so the router's planning is what the ratio measures;
routed-ar itself with in-process ar.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.bench import llamacpp_build
from specpool.bench.modes import PEERS, BenchConfig, ModeTotals, build_runners, mode_hardware
from specpool.bench.remote import REMOTE_MODES, ROUTED_METHODS, SSD_LAYOUT, X2
from specpool.common.machine import machine_info
from specpool.engine.policy.draft_length import SpeculationPolicy
from specpool.engine.runtime.device import draft_format, resolve_dtype
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

NEAR_TIE = 1e-4  # top-2 logit gap under which a greedy divergence is rounding, not a bug


def first_divergence_gap(model: Llama, prompt: list[int], ref: list[int], out: list[int]) -> float:
    """The target's top-2 logit gap where `out` first departs from the greedy `ref` (or ends early)."""
    i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    cache = model.new_cache(1, len(prompt) + i + 1)
    logits = model.forward(cache, [cache.allocate()], [prompt + ref[:i]])[0]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def run_bench(cfg: BenchConfig) -> dict:
    from specpool.bench.workloads import load_workload

    started = time.perf_counter()
    model, tokenizer = Llama.from_path(cfg.model_path, dtype=cfg.dtype)
    start_s = time.perf_counter() - started  # the file read, q4's repacking, the kernels' build or load
    prompts = load_workload(cfg.workload, tokenizer, cfg.limit)
    remote = None
    if any(m.partition(":")[0] in REMOTE_MODES for m in cfg.modes):
        from specpool.bench.remote import RemoteCluster

        remote = RemoteCluster(cfg.model_path, cfg.dtype, max(cfg.batch_sizes), cfg.draft_dir, cfg.datastore,
                               delay_ms=cfg.spec_delay_ms, threads=cfg.threads,
                               endpoint_args=("--dtype", cfg.draft_dtype, *cfg.endpoint_args),
                               target_args=cfg.target_args, head_dir=cfg.head_dir)
    routed = None
    if any(m in ROUTED_METHODS for m in cfg.modes):
        from specpool.bench.remote import RoutedCluster

        routed = RoutedCluster(cfg.model_path, cfg.cluster_config, cfg.ray_address)
    try:
        rows = _run_batches(cfg, model, prompts, remote, routed)
    finally:
        for servers in (remote, routed):
            if servers is not None:
                servers.close()
    return {
        "machine": machine_info(),
        "model": cfg.model_path.name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "weight_format": model.format.name,  # q4: the GGUF's 4-bit blocks (engine/runtime/linear.py)
        "format_check": model.format_label,  # which kernels carry it, and its start-up row check
        # The llama.cpp build the llamacpp-* modes ran (bench/llamacpp_build.py: its ISA flags, AMX off).
        "llamacpp_build": llamacpp_build.installed() if any(m.startswith("llamacpp") for m in cfg.modes) else None,
        # llamacpp-sd's llama-speculative-simple, built from the same source with the same ISA flags.
        "llamacpp_speculative_build": llamacpp_build.speculative_plan()
        if any(m.partition(":")[0] == "llamacpp-sd" for m in cfg.modes) else None,
        "draft_format": _draft_format(cfg.draft_dtype, model.device),
        "policy_min_gain": SpeculationPolicy.min_gain,
        "ssd_layout": SSD_LAYOUT if any(m in ("ssd", "ssd-pull") for m in cfg.modes) else None,
        "workload": cfg.workload,
        "limit": cfg.limit,
        "max_tokens": cfg.max_tokens,
        "draft": str(cfg.draft_dir) if cfg.draft_dir else None,
        "head": str(cfg.head_dir) if cfg.head_dir else None,
        "datastore": str(cfg.datastore) if cfg.datastore else None,
        "target": target_profile(model, start_s, rows),
        "results": rows,
    }


def _draft_format(name: str, device: torch.device) -> str:
    """What the drafts ran: q8_0 blocks, or their dense dtype."""
    dtype, blocks = draft_format(name, device)
    return blocks.name.lower() if blocks else str(resolve_dtype(dtype, device)).removeprefix("torch.")


def target_profile(model: Llama, start_s: float, rows: list[dict]) -> dict:
    """What the target's format costs: its start, AR at batch 1 against the bandwidth floor (the bytes of
    weights a step reads over the memory bandwidth measured now), and the verify step's cost T(B, K) for
    K drafts over T(B, 0), at batch 1 and 16 (fresh, best of 5, not the policy's cached table)."""
    from specpool.bench.ar_speed import weight_bytes
    from specpool.common.machine import memory_read_gbps
    from specpool.engine.policy.costs import measure_step_costs

    lens = (0, 1, 2, 4, 8)
    costs = measure_step_costs(model, (1, 16), lens, repeats=5).seconds
    floor = weight_bytes(model) / (memory_read_gbps() * 1e9)
    ar = next((r for r in rows if r["mode"] == "ar" and r["batch_size"] == 1), None)
    return {
        "format": model.format.name,
        "fused_kernels": model.fused,
        "start_s": round(start_s, 2),
        "bandwidth_floor_s": round(floor, 5),
        "ar_batch1_times_floor": round(ar["time_per_output_token_s"] / floor, 2) if ar else None,
        "verify_step_ms": {b: {k: round(t * 1e3, 2) for k, t in zip(lens, row)} for b, row in zip((1, 16), costs)},
        "verify_step_vs_k0": {b: {k: round(t / row[0], 3) for k, t in zip(lens, row)} for b, row in zip((1, 16), costs)},
    }


def _reference(mode: str, modes) -> str:
    if mode.startswith("hf-"):
        return "hf-ar"
    if mode.startswith("llamacpp-"):
        return "llamacpp-ar"
    if mode == "routed-ray" and "routed-ray-ar" in modes:
        return "routed-ray-ar"
    if mode in ("routed", "routed-http", "routed-ray") and "routed-ar" in modes:
        return "routed-ar"
    # Through the servers, against plain decoding on the same target processes when it ran.
    twin = "ar" + mode.partition(":")[0].removeprefix("sd")
    if mode.startswith("sd-remote") and twin in ("ar-remote", "ar-remote" + X2) and twin in modes:
        return twin
    return "ar"


def _ar_speed(totals: dict[str, ModeTotals], cores: int, threads: int) -> float | None:
    """AR's tokens/s on this many cores in the same run (`ar` runs on the bench's threads)."""
    ref = totals.get("ar" if cores == threads else f"ar@{cores}")
    return ref.new_tokens / ref.seconds if ref and ref.seconds else None


def _compared(prompts, ref_outputs, outputs, same, gap, tie) -> tuple[bool, int]:
    """(whether every output matches the reference's but for near ties, how many near ties)."""
    near, bad = 0, 0
    for p, r, o in zip(prompts, ref_outputs, outputs):
        if not same(r, o):
            if gap(p, r, o) < tie:
                near += 1
            else:
                bad += 1
    return bad == 0, near


def round_budget(counts: Counter[str]) -> dict[str, float] | None:
    """Where a remote mode's decode round went, in ms per target round (None: no round counted): its whole step, the
    verify forward with acceptance, the wait for the endpoint's drafts and the wire's share of that wait, the rest
    (the policy, bookkeeping), and the endpoint's drafting per round (overlapping the verify where SSD
    pre-speculates)."""
    if not counts["rounds"]:
        return None
    per_round = {name: 1e3 * counts[key] / counts["rounds"] for name, key in (
        ("round", "round_s"), ("verify", "verify_s"), ("waiting_for_drafts", "draft_wait_s"), ("wire", "wire_s"),
        ("endpoint_drafting", "endpoint_draft_s"))}
    per_round["rest"] = per_round["round"] - per_round["verify"] - per_round["waiting_for_drafts"]
    return {name: round(ms, 2) for name, ms in per_round.items()}


def _target_speed(ref: ModeTotals, i: int) -> float:
    """The reference's tokens/s on its i-th target (a mode of one target: its own)."""
    one = ref.targets[i] if ref.targets else ref
    return one.new_tokens / one.seconds


def _run_batches(cfg: BenchConfig, model: Llama, prompts: list[list[int]], remote, routed) -> list[dict]:
    rows = []
    for b in cfg.batch_sizes:
        runners = {m: r for m, r in build_runners(cfg, model, b, remote, routed).items() if r is not None}
        totals = {m: ModeTotals() for m in runners}
        chunks = [prompts[i : i + b] for i in range(0, len(prompts), b)]
        order = list(runners)
        for c, chunk in enumerate(tqdm(chunks, desc=f"batch {b}", unit="chunk")):
            params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + c)
            # The order rotates by one mode per chunk: no mode always runs right after another (a
            # machine's slow spells and warm caches then fall on every mode alike).
            for mode in order[c % len(order):] + order[: c % len(order)]:
                runners[mode](chunk, params, totals[mode])
        threads = torch.get_num_threads()
        llamacpp = totals.get("llamacpp-ar")
        for mode, t in totals.items():
            ref = totals.get(_reference(mode, totals))
            tps = t.new_tokens / t.seconds
            hw = mode_hardware(mode, threads)
            on_target, on_all = (_ar_speed(totals, n, threads) for n in (hw.target_cores, hw.cores))
            row = {
                "mode": mode,
                "batch_size": b,
                "temperature": cfg.temperature,
                "tokens_per_s": round(tps, 2),
                "time_per_output_token_s": round(t.seconds / t.new_tokens, 5),
                "mean_accept_len": round((t.new_tokens - t.first_tokens) / t.target_steps, 3)
                if t.target_steps
                else None,
                "mean_draft_len": round(t.drafted / t.target_steps, 2) if t.target_steps and t.drafted else None,
                "cache_hit_ratio": round(t.cache_hits / t.cache_lookups, 3) if t.cache_lookups else None,
                # verify-step time / mean accepted length: the time per token if drafting cost nothing
                "draft_free_bound_s": round(c["verify_s"] / t.new_tokens, 5) if (c := t.server_counts)["verify_s"] else None,
                "speedup_vs_ar": round(tps / (ref.new_tokens / ref.seconds), 3) if ref else None,
                "speedup_vs_llamacpp_ar": round(tps / (llamacpp.new_tokens / llamacpp.seconds), 3) if llamacpp else None,
                "target_cores": hw.target_cores,
                "cores_used": hw.cores,
                "hardware": hw.layout,
                # AR on the target's cores alone, and on every core this mode used (drafter included)
                "speedup_vs_ar_target_cores": round(tps / on_target, 3) if on_target else None,
                "speedup_vs_ar_all_cores": round(tps / on_all, 3) if on_all else None,
                "outputs_match_ar": None,
                "near_ties": None,
                "fallback_rounds": t.fallback_rounds,
                # the endpoint's: what batching sequences (of one target, or of several) into one forward saves
                "draft_forwards_per_target_token": round(c["draft_forwards"] / c["endpoint_target_tokens"], 3)
                if c["endpoint_target_tokens"] else None,
                "round_budget_ms": round_budget(t.server_counts),
                # what capacity planning reads (`specpool plan`): the targets' policies' own prediction of this
                # speedup (read between chunks, when the next request would run alone: batch 1's only), and the
                # endpoint's drafting in core-seconds (busy seconds x its threads)
                "predicted_speedup": round(sum(t.predicted_speedups) / len(t.predicted_speedups), 3)
                if t.predicted_speedups and b == 1 else None,
                "drafter_core_s_per_token": round(c["endpoint_draft_s"] * t.drafter_threads / t.new_tokens, 5)
                if t.drafter_threads else None,
                "drafter_cores_busy": round(c["endpoint_draft_s"] * t.drafter_threads / t.seconds, 3)
                if t.drafter_threads else None,
                "drafter_threads": t.drafter_threads,
                # -x2 modes: each target's own rate, against the same target in the reference (its sum alone else)
                "targets": [{"tokens_per_s": round(o.new_tokens / o.seconds, 2),
                             "speedup_vs_ar": round(o.new_tokens / o.seconds / _target_speed(ref, i), 3)
                             if ref else None,
                             "outputs_match_ar": None, "near_ties": None} for i, o in enumerate(t.targets)] or None,
                # Two runs (say, before and after a refactor) made the same tokens iff these match.
                "outputs_sha256": hashlib.sha256(json.dumps(t.outputs).encode()).hexdigest(),
            }
            if ref is not None and cfg.temperature == 0 and mode != "ar-fp32":
                gap, tie = lambda p, r, o: first_divergence_gap(model, p, r, o), NEAR_TIE
                same = lambda r, o: r == o
                if mode.startswith("llamacpp-"):  # its own logits, and its kernels' looser agreement
                    from specpool.bench.llamacpp_peer import NEAR_TIE as LLAMACPP_NEAR_TIE

                    gap, tie = PEERS["llamacpp"].divergence_gap, LLAMACPP_NEAR_TIE
                if mode.partition(":")[0] == "llamacpp-sd":  # its output is text, re-tokenized: compared as text
                    same = PEERS["llamacpp-sd"].vocab.same_output
                if t.targets:  # each target's outputs, with the same target's in the reference
                    for i, (o, cells) in enumerate(zip(t.targets, row["targets"])):
                        ref_outputs = ref.targets[i].outputs if ref.targets else ref.outputs
                        matched = _compared(prompts, ref_outputs, o.outputs, same, gap, tie)
                        cells["outputs_match_ar"], cells["near_ties"] = matched
                    row["outputs_match_ar"] = all(c["outputs_match_ar"] for c in row["targets"])
                    row["near_ties"] = sum(c["near_ties"] for c in row["targets"])
                else:
                    row["outputs_match_ar"], row["near_ties"] = _compared(prompts, ref.outputs, t.outputs, same, gap, tie)
            rows.append(row)
    return rows


def print_table(report: dict) -> None:
    t = report["target"]
    print(f"target: {report['model']} as {t['format']}" + (" (fused kernels)" if t["fused_kernels"] else "")
          + f", started in {t['start_s']:.1f} s; AR batch 1 at "
          + (f"{t['ar_batch1_times_floor']:.1f}x" if t["ar_batch1_times_floor"] else "-")
          + f" the bandwidth floor ({1e3 * t['bandwidth_floor_s']:.1f} ms/token)")
    for b, ratios in t["verify_step_vs_k0"].items():
        print(f"verify step T({b},K)/T({b},0): " + ", ".join(f"K={k} {r:.2f}" for k, r in ratios.items() if k)
              + f" (T({b},0) {t['verify_step_ms'][b][0]:.1f} ms)")
    cols = [("mode", 18), ("batch_size", 5), ("temperature", 5), ("tokens_per_s", 8), ("time_per_output_token_s", 8),
            ("draft_free_bound_s", 8), ("mean_accept_len", 7), ("mean_draft_len", 6), ("cache_hit_ratio", 5),
            ("speedup_vs_ar", 7), ("speedup_vs_llamacpp_ar", 7), ("cores_used", 5), ("speedup_vs_ar_target_cores", 7),
            ("speedup_vs_ar_all_cores", 7), ("outputs_match_ar", 6), ("near_ties", 5),
            ("draft_forwards_per_target_token", 7)]
    heads = ["mode", "batch", "temp", "tok/s", "s/tok", "bound", "accept", "draft", "hit", "speedup", "vs-llcpp", "cores",
             "vs-tgt", "vs-all", "match", "ties", "fwd/tok"]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, (_, w)) in enumerate(zip(heads, cols))))
    for row in report["results"]:
        cells = []
        for i, (key, w) in enumerate(cols):
            v = row[key]
            text = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            cells.append(text.ljust(w) if i == 0 else text.rjust(w))
        print("  ".join(cells))
        if row["drafter_cores_busy"] is not None:
            print(f"  drafter: {row['drafter_cores_busy']:.3g} cores busy, {1e3 * row['drafter_core_s_per_token']:.3g} "
                  "core-ms a target token; predicted speedup "
                  + ("-" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.3g}"))
        if budget := row["round_budget_ms"]:
            print("  round, ms: " + ", ".join(f"{name.replace('_', ' ')} {ms:.1f}" for name, ms in budget.items()))
        for i, target in enumerate(row["targets"] or []):
            print(f"  target {i + 1}: {target['tokens_per_s']:.4g} tok/s, speedup "
                  + ("-" if target["speedup_vs_ar"] is None else f"{target['speedup_vs_ar']:.4g}")
                  + f", match {target['outputs_match_ar']}")


def write_report(report: dict, path: Path | None, command: str) -> None:
    report = {"command": command} | report
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
