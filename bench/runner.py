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
the modes through servers in bench/remote.py. routed and routed-http are compared with routed-ar (AR
through the same router and servers) when both run, so the router's planning is what the ratio measures;
routed-ar itself with in-process ar.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.bench.remote import REMOTE_MODES, ROUTED_METHODS, SSD_ENDPOINT_CPUS, SSD_LAYOUT, SSD_TARGET_CPUS
from specpool.common.machine import machine_info
from specpool.engine.decoding import generate
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.drafters.hybrid import HybridDraftLength, HybridTreeDrafter, ModelShare
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.drafters.suffix_store import SuffixStore
from specpool.engine.drafters.trees import TreeShape
from specpool.engine.runtime.device import resolve_dtype
from specpool.engine.runtime.model import Llama
from specpool.engine.speculation_policy import AcceptanceEstimate, SpeculationPolicy, cached_step_costs
from specpool.engine.verification.sampling import SamplingParams

TREE_SHAPE = TreeShape(branch=4, beam=4, max_depth=6)  # the tree modes' (EAGLE-2's defaults, scaled to CPU budgets)
NEAR_TIE = 1e-4  # top-2 logit gap under which a greedy divergence is rounding, not a bug


@dataclass
class ModeTotals:
    new_tokens: int = 0
    seconds: float = 0.0
    target_steps: int | None = None
    first_tokens: int = 0
    drafted: int = 0
    fallback_rounds: int | None = None  # remote modes: rounds the target drafted locally
    cache_hits: int = 0  # SSD: rounds whose drafts came from the speculation cache
    cache_lookups: int = 0
    verify_seconds: float | None = None  # remote modes: the target's verify forwards, drafting excluded
    outputs: list[list[int]] = field(default_factory=list)


@dataclass
class BenchConfig:
    model_path: Path
    workload: str
    limit: int | None
    max_tokens: int
    batch_sizes: list[int]
    temperature: float
    modes: list[str]
    draft_dir: Path | None
    datastore: Path | None
    head_dir: Path | None = None  # the feature-fed head (modes head, head-tree, head-suffix)
    dtype: str = "auto"  # the target's
    draft_dtype: str = "bf16"  # the draft model's (bf16 where native: its speed matters, its q is sent exactly)
    seed: int = 0
    spec_delay_ms: float = 0.0  # injected per speculation message in the remote modes
    threads: int | None = None  # torch threads of the in-process modes, and of the remote modes' servers
    cluster_config: Path | None = None  # routed modes: the cluster (None: cluster/default.yaml)
    ray_address: str | None = None  # routed-ray modes: the Ray cluster (None: a one-node Ray of the run's own)
    endpoint_args: tuple[str, ...] = ()  # remote modes: further serve-spec flags


# A runner takes a chunk of prompts and fills one ModeTotals.
Runner = Callable[[list[list[int]], SamplingParams, ModeTotals], None]


def _ours(model: Llama, max_tokens: int, drafter_factory=None, k: int = 0, policy=None,
          threads: int | None = None) -> Runner:
    """In-process decoding; `threads`: torch's thread count while this mode runs (AR on fewer cores)."""
    # A policy learns acceptance across the whole workload, as a server's decoder does across requests.
    acceptance = AcceptanceEstimate() if policy is not None else None

    def run(prompts, params, totals):
        drafter = drafter_factory(len(prompts)) if drafter_factory else None
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            start = time.perf_counter()
            results = generate(model, prompts, params, max_tokens, drafter, k, policy=policy, acceptance=acceptance)
            totals.seconds += time.perf_counter() - start
        finally:
            torch.set_num_threads(before)
        totals.target_steps = (totals.target_steps or 0) + sum(r.target_steps for r in results)
        for r in results:
            totals.new_tokens += len(r.token_ids)
            totals.first_tokens += 1
            totals.drafted += r.drafted_tokens
            totals.outputs.append(r.token_ids)

    return run


def _hf(fn) -> Runner:
    def run(prompts, params, totals):
        out = fn(prompts, params)
        totals.seconds += out.seconds
        totals.new_tokens += out.new_tokens
        totals.outputs.extend(out.token_ids)

    return run


@dataclass(frozen=True, slots=True)
class Hardware:
    """The cores a mode's target and its drafter ran on: its speedup is honest only against AR on the
    target's cores alone and against AR on every core the mode used."""

    target_cores: int
    cores: int  # every core the mode's processes could use, drafter included
    layout: str


def mode_hardware(mode: str, threads: int) -> Hardware:
    name = mode.partition(":")[0]
    machine = len(os.sched_getaffinity(0))
    if name.startswith("ar@"):
        n = int(name[3:])
        return Hardware(n, n, f"in process, {n} threads")
    if name in ("ssd", "ssd-pull"):
        return Hardware(len(SSD_TARGET_CPUS), len(SSD_TARGET_CPUS) + len(SSD_ENDPOINT_CPUS), SSD_LAYOUT)
    if name in REMOTE_MODES or name in ROUTED_METHODS:
        return Hardware(threads, machine, f"target and endpoint processes, {threads} threads each, on all "
                                          f"{machine} cores")
    return Hardware(threads, threads, f"in process, {threads} threads shared by target and drafter")


def build_runners(cfg: BenchConfig, model: Llama, batch_size: int, remote=None, routed=None) -> dict[str, Runner]:
    runners: dict[str, Runner] = {}
    needs_draft = any(m.split(":")[0] in ("sd", "sd-tree", "hf-assisted") for m in cfg.modes)
    draft = None
    if needs_draft:
        if cfg.draft_dir is None or not (cfg.draft_dir / "model.safetensors").exists():
            raise FileNotFoundError(f"modes sd/hf-assisted need a draft checkpoint; none at {cfg.draft_dir}")
        draft = Llama.from_draft_checkpoint(cfg.draft_dir, model.embed.float().cpu(), cfg.draft_dtype, str(model.device))
    if cfg.datastore and not cfg.datastore.exists():
        raise FileNotFoundError(f"no n-gram datastore at {cfg.datastore}: build one with `specpool build-datastore`"
                                " or pass --datastore '' to use the per-request index alone")
    datastore = SuffixArrayDatastore.load(cfg.datastore) if cfg.datastore else None
    head = None
    if any(m.split(":")[0] in ("head", "head-tree", "head-suffix") for m in cfg.modes):
        if cfg.head_dir is None or not (cfg.head_dir / "model.safetensors").exists():
            raise FileNotFoundError(f"modes head/head-tree need a head checkpoint (`specpool train-draft --kind "
                                    f"head`); none at {cfg.head_dir}")
        head = Llama.from_draft_checkpoint(cfg.head_dir, model.embed.float().cpu(), cfg.draft_dtype, str(model.device))
    max_len = 4096

    target_costs = None
    for mode in cfg.modes:
        name, _, k = mode.partition(":")
        if name in ("sd", "ngram", "head", "sd-tree", "head-tree", "head-suffix") and not k and target_costs is None:
            target_costs = cached_step_costs(model, cfg.model_path.name)
        if name == "ar":
            runners[mode] = _ours(model, cfg.max_tokens)
        elif name == "ar-fp32":  # the reference format beside the default one (its own numerics: no match)
            runners[mode] = _ours(Llama.from_gguf(cfg.model_path, dtype="fp32", device=str(model.device))[0],
                                  cfg.max_tokens)
        elif name.startswith("ar@"):
            runners[mode] = _ours(model, cfg.max_tokens, threads=int(name[3:]))
        elif name == "sd":
            policy = None if k else SpeculationPolicy(
                target_costs, draft_costs=cached_step_costs(draft, str(cfg.draft_dir)), max_draft=8
            )
            runners[mode] = _ours(
                model, cfg.max_tokens, lambda b: ModelDrafter(draft, b, max_len), int(k or 0), policy
            )
        elif name == "head":
            policy = None if k else SpeculationPolicy(
                target_costs, draft_costs=cached_step_costs(head, str(cfg.head_dir)), max_draft=8
            )
            runners[mode] = _ours(model, cfg.max_tokens, lambda b: HeadDrafter(head, b, max_len), int(k or 0), policy)
        elif name in ("sd-tree", "head-tree", "head-suffix"):  # k: every tree's node budget (none: the policy's)
            make = ModelDrafter if name == "sd-tree" else HeadDrafter
            source, source_dir = (draft, cfg.draft_dir) if name == "sd-tree" else (head, cfg.head_dir)
            policy = None if k else SpeculationPolicy(
                target_costs, draft_costs=cached_step_costs(source, str(source_dir)), max_draft=16, tree=TREE_SHAPE)
            factory = lambda b, make=make, source=source: make(source, b, max_len, tree=TREE_SHAPE)
            if name == "head-suffix":  # one store for the whole workload, as a server's tenant has
                store, share = SuffixStore(max_tokens=200_000), ModelShare()
                factory = lambda b, model_drafter=factory, store=store, share=share: HybridTreeDrafter(
                    model_drafter(b), store, share=share)
                policy = policy and HybridDraftLength(policy, share)
            runners[mode] = _ours(model, cfg.max_tokens, factory, int(k or 0), policy)
        elif name == "ngram":
            policy = None if k else SpeculationPolicy(target_costs, max_draft=16)
            runners[mode] = _ours(model, cfg.max_tokens, lambda b: NgramDrafter(datastore), int(k or 0), policy)
        elif name in REMOTE_MODES:
            runners[mode] = remote.runner(name, cfg.max_tokens, int(k or 0))
        elif name in ROUTED_METHODS:
            runners[mode] = routed.runner(name, cfg.max_tokens)
        elif name.startswith("hf-"):
            runners[mode] = _hf_runner(name, cfg, batch_size)
        elif name in ("llamacpp-ar", "llamacpp-lookup"):
            runners[mode] = _llamacpp_runner(cfg, batch_size, int(k or 10) if name == "llamacpp-lookup" else 0)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    # AR on the cores of every mode that used fewer, or more, than the bench's own threads.
    threads = torch.get_num_threads()
    for mode in list(runners):
        hw = mode_hardware(mode, threads)
        for n in {hw.target_cores, hw.cores} - {threads}:
            runners.setdefault(f"ar@{n}", _ours(model, cfg.max_tokens, threads=n))
    return runners


_PEERS: dict[str, object] = {}


def _hf_runner(name: str, cfg: BenchConfig, batch_size: int) -> Runner | None:
    from specpool.bench import peers

    if "target" not in _PEERS:
        _PEERS["target"] = peers.load_hf_target(cfg.model_path)
    hf = _PEERS["target"]
    if name == "hf-ar":
        return _hf(lambda p, sp: peers.hf_generate(
            hf, p, cfg.max_tokens, batch_size=batch_size, temperature=sp.temperature, seed=sp.seed))
    if batch_size != 1:
        return None  # transformers runs prompt lookup and assisted generation at batch 1 only
    if name == "hf-prompt-lookup":
        return _hf(lambda p, sp: peers.hf_prompt_lookup(
            hf, p, cfg.max_tokens, num_tokens=10, temperature=sp.temperature, seed=sp.seed))
    if name == "hf-assisted":
        if "draft" not in _PEERS:
            _PEERS["draft"] = peers.load_hf_draft(cfg.draft_dir, cfg.model_path)
        draft = _PEERS["draft"]
        return _hf(lambda p, sp: peers.hf_assisted(
            hf, draft, p, cfg.max_tokens, temperature=sp.temperature, seed=sp.seed))
    raise ValueError(f"unknown mode {name!r}")


def _llamacpp_runner(cfg: BenchConfig, batch_size: int, lookup: int) -> Runner:
    """llama.cpp decoding each chunk's prompts as one batch of sequences on the bench's threads."""
    from specpool.bench.llamacpp_peer import LlamaCpp

    if _PEERS.get("llamacpp_batch") != batch_size:  # one context per batch size: its sequence count
        if "llamacpp" in _PEERS:
            _PEERS["llamacpp"].close()
        _PEERS["llamacpp"] = LlamaCpp(cfg.model_path, torch.get_num_threads(), sequences=batch_size)
        _PEERS["llamacpp_batch"] = batch_size
    llm = _PEERS["llamacpp"]
    return _hf(lambda p, sp: llm.generate(p, cfg.max_tokens, sp.temperature, sp.seed, lookup=lookup))


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
    model, tokenizer = Llama.from_gguf(cfg.model_path, dtype=cfg.dtype)
    start_s = time.perf_counter() - started  # the file read, q4's repacking, the kernels' build or load
    prompts = load_workload(cfg.workload, tokenizer, cfg.limit)
    remote = None
    if any(m.partition(":")[0] in REMOTE_MODES for m in cfg.modes):
        from specpool.bench.remote import RemoteCluster

        remote = RemoteCluster(cfg.model_path, cfg.dtype, max(cfg.batch_sizes), cfg.draft_dir, cfg.datastore,
                               delay_ms=cfg.spec_delay_ms, threads=cfg.threads,
                               endpoint_args=("--dtype", cfg.draft_dtype, *cfg.endpoint_args), head_dir=cfg.head_dir)
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
        "draft_dtype": str(resolve_dtype(cfg.draft_dtype, model.device)).removeprefix("torch."),
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


def target_profile(model: Llama, start_s: float, rows: list[dict]) -> dict:
    """What the target's format costs: its start, AR at batch 1 against the bandwidth floor (the bytes of
    weights a step reads over the memory bandwidth measured now), and the verify step's cost T(B, K) for
    K drafts over T(B, 0), at batch 1 and 16 (fresh, best of 5, not the policy's cached table)."""
    from specpool.bench.ar_speed import weight_bytes
    from specpool.common.machine import memory_read_gbps
    from specpool.engine.speculation_policy import measure_step_costs

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
    return "ar"


def _ar_speed(totals: dict[str, ModeTotals], cores: int, threads: int) -> float | None:
    """AR's tokens/s on this many cores in the same run (`ar` runs on the bench's threads)."""
    ref = totals.get("ar" if cores == threads else f"ar@{cores}")
    return ref.new_tokens / ref.seconds if ref and ref.seconds else None


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
                "draft_free_bound_s": round(t.verify_seconds / t.new_tokens, 5) if t.verify_seconds else None,
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
                # Two runs (say, before and after a refactor) made the same tokens iff these match.
                "outputs_sha256": hashlib.sha256(json.dumps(t.outputs).encode()).hexdigest(),
            }
            if ref is not None and cfg.temperature == 0 and mode != "ar-fp32":
                near, bad = 0, 0
                gap, tie = lambda p, r, o: first_divergence_gap(model, p, r, o), NEAR_TIE
                if mode.startswith("llamacpp-"):  # its own logits, and its kernels' looser agreement
                    from specpool.bench.llamacpp_peer import NEAR_TIE as LLAMACPP_NEAR_TIE

                    gap, tie = _PEERS["llamacpp"].divergence_gap, LLAMACPP_NEAR_TIE
                for p, r, o in zip(prompts, ref.outputs, t.outputs):
                    if r != o:
                        if gap(p, r, o) < tie:
                            near += 1
                        else:
                            bad += 1
                row["outputs_match_ar"], row["near_ties"] = bad == 0, near
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
            ("speedup_vs_ar_all_cores", 7), ("outputs_match_ar", 6), ("near_ties", 5)]
    heads = ["mode", "batch", "temp", "tok/s", "s/tok", "bound", "accept", "draft", "hit", "speedup", "vs-llcpp", "cores",
             "vs-tgt", "vs-all", "match", "ties"]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, (_, w)) in enumerate(zip(heads, cols))))
    for row in report["results"]:
        cells = []
        for i, (key, w) in enumerate(cols):
            v = row[key]
            text = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            cells.append(text.ljust(w) if i == 0 else text.rjust(w))
        print("  ".join(cells))


def write_report(report: dict, path: Path | None, command: str) -> None:
    report = {"command": command} | report
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
