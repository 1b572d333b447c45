"""The bench's modes: what each mode name runs (in process, through servers, or a peer runtime), on
which cores, and the totals it fills (bench/totals.py). bench/runner.py runs them side by side."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specpool.bench.remote import (
    REMOTE_MODES,
    ROUTED_METHODS,
    SSD_ENDPOINT_CPUS,
    SSD_LAYOUT,
    SSD_TARGET_CPUS,
    X2,
)
from specpool.bench.totals import ModeTotals
from specpool.engine.decoding import generate
from specpool.engine.drafters import registry
from specpool.engine.drafters.hybrid import HybridTreeDrafter
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.drafters.registry import DraftSources
from specpool.engine.drafters.suffix_store import SuffixStore
from specpool.engine.method import METHODS, Method
from specpool.engine.plan import TreeShape
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import cached_step_costs
from specpool.engine.policy.draft_length import HybridDraftLength, ModelShare, SpeculationPolicy
from specpool.engine.runtime.draft_pair import is_model_file, load_draft
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams

TREE_SHAPE = TreeShape(branch=4, beam=4, max_depth=6)  # the tree modes' (EAGLE-2's defaults, scaled to CPU budgets)
# In-process modes, each built by the drafter registry: a method's first bench mode drafts chains (where it
# runs in process: not SSD, which needs an endpoint to pre-speculate), the tree modes grow TREE_SHAPE trees.
CHAIN_MODES = {row.bench_modes[0]: row.method for row in METHODS
               if row.drafter is not None and row.bench_modes and row.bench_modes[0] not in REMOTE_MODES}
# The -suffix modes: the hybrid, suffix-store trees where the store is sure and the model's elsewhere.
GROWN_TREE_MODES = {"sd-tree": Method.DRAFT_MODEL, "sd-suffix": Method.DRAFT_MODEL, "head-tree": Method.HEAD,
                    "head-suffix": Method.HEAD}


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
    draft_dtype: str = "auto"  # the draft model's and the head's (engine/runtime/device.py draft_format)
    seed: int = 0
    spec_delay_ms: float = 0.0  # injected per speculation message in the remote modes
    threads: int | None = None  # torch threads of the in-process modes, and of the remote modes' servers
    cluster_config: Path | None = None  # routed modes: the cluster (None: cluster/examples/smollm2.yaml)
    ray_address: str | None = None  # routed-ray modes: the Ray cluster (None: a one-node Ray of the run's own)
    endpoint_args: tuple[str, ...] = ()  # remote modes: further serve-spec flags
    target_args: tuple[str, ...] = ()  # remote modes: further serve-target flags


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
    if name.endswith(X2):
        return Hardware(threads, machine, f"two target processes and an endpoint, {threads} threads each, on all "
                                          f"{machine} cores")
    if name == "llamacpp-sd":  # target and draft take turns on the same threads, in one llama.cpp process
        return Hardware(threads, threads, f"llama.cpp process, target and draft each on the same {threads} threads")
    if name in REMOTE_MODES or name in ROUTED_METHODS:
        return Hardware(threads, machine, f"target and endpoint processes, {threads} threads each, on all "
                                          f"{machine} cores")
    return Hardware(threads, threads, f"in process, {threads} threads shared by target and drafter")


def build_runners(cfg: BenchConfig, model: Llama, batch_size: int, remote=None, routed=None) -> dict[str, Runner]:
    runners: dict[str, Runner] = {}
    needs_draft = any(m.split(":")[0] in ("sd", "sd-tree", "sd-suffix", "hf-assisted") for m in cfg.modes)
    draft = None
    if needs_draft:
        if cfg.draft_dir is not None and cfg.draft_dir.exists() and is_model_file(cfg.draft_dir):
            # a model of its own sharing the target's tokenizer (the Qwen pair's 0.5B): refused here otherwise
            draft = load_draft(cfg.draft_dir, cfg.model_path, model.config.vocab_size, cfg.draft_dtype, str(model.device))
        elif cfg.draft_dir is None or not (cfg.draft_dir / "model.safetensors").exists():
            raise FileNotFoundError(f"modes sd/hf-assisted need a draft checkpoint or model file; none at {cfg.draft_dir}")
        else:
            draft = Llama.from_draft_checkpoint(cfg.draft_dir, model.embed.float().cpu(), cfg.draft_dtype,
                                                str(model.device))
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
    sources = DraftSources(max_sequences=1, max_len=4096, draft=draft, head=head, datastore=datastore,
                           tree_shape=TREE_SHAPE)
    checkpoints = {Method.DRAFT_MODEL: (draft, cfg.draft_dir), Method.HEAD: (head, cfg.head_dir)}

    def draft_costs(method: Method):
        """The step costs of the model a method drafts with (None: it drafts with none)."""
        if method not in checkpoints:
            return None
        source, source_dir = checkpoints[method]
        return cached_step_costs(source, str(source_dir))

    def built(method: Method, trees: bool = False):
        """A factory of the method's drafter for a batch of b sequences, from the registry."""
        return lambda b: registry.build(method, dataclasses.replace(sources, max_sequences=b, trees=trees))

    target_costs = None
    for mode in cfg.modes:
        name, _, k = mode.partition(":")
        if (name in CHAIN_MODES or name in GROWN_TREE_MODES) and not k and target_costs is None:
            target_costs = cached_step_costs(model, cfg.model_path.name)
        if name == "ar":
            runners[mode] = _ours(model, cfg.max_tokens)
        elif name == "ar-fp32":  # the reference format beside the default one (its own numerics: no match)
            runners[mode] = _ours(Llama.from_path(cfg.model_path, dtype="fp32", device=str(model.device))[0],
                                  cfg.max_tokens)
        elif name.startswith("ar@"):
            runners[mode] = _ours(model, cfg.max_tokens, threads=int(name[3:]))
        elif name in CHAIN_MODES:
            method = CHAIN_MODES[name]
            policy = None if k else SpeculationPolicy(target_costs, draft_costs=draft_costs(method),
                                                      max_draft=method.row.max_draft)
            runners[mode] = _ours(model, cfg.max_tokens, built(method), int(k or 0), policy)
        elif name in GROWN_TREE_MODES:  # k: every tree's node budget (none: the policy's)
            method = GROWN_TREE_MODES[name]
            policy = None if k else SpeculationPolicy(target_costs, draft_costs=draft_costs(method), max_draft=16,
                                                      tree=TREE_SHAPE)
            factory = built(method, trees=True)
            if name.endswith("-suffix"):  # one store for the whole workload, as a server's tenant has
                store, share = SuffixStore(max_tokens=200_000), ModelShare()
                factory = lambda b, model_drafter=factory, store=store, share=share: HybridTreeDrafter(
                    model_drafter(b), store, share=share)
                policy = policy and HybridDraftLength(policy, share)
            runners[mode] = _ours(model, cfg.max_tokens, factory, int(k or 0), policy)
        elif name in REMOTE_MODES:
            if name.startswith("ar-") and not k:  # on the targets of its sd twin (ar-remote: sd-remote[:K]), if run
                twin = "sd" + name.removeprefix("ar")
                k = next((m.partition(":")[2] for m in cfg.modes if m.partition(":")[0] == twin), "")
            runners[mode] = remote.runner(name, cfg.max_tokens, int(k or 0))
        elif name in ROUTED_METHODS:
            runners[mode] = routed.runner(name, cfg.max_tokens)
        elif name.startswith("hf-"):
            runners[mode] = _hf_runner(name, cfg, batch_size)
        elif name in ("llamacpp-ar", "llamacpp-lookup"):
            runners[mode] = _llamacpp_runner(cfg, batch_size, int(k or 10) if name == "llamacpp-lookup" else 0)
        elif name == "llamacpp-sd":  # k: its draft length (--spec-draft-n-max)
            runners[mode] = _llamacpp_sd_runner(cfg, batch_size, int(k or 4))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    # AR on the cores of every mode that used fewer, or more, than the bench's own threads.
    threads = torch.get_num_threads()
    for mode in list(runners):
        hw = mode_hardware(mode, threads)
        for n in {hw.target_cores, hw.cores} - {threads}:
            runners.setdefault(f"ar@{n}", _ours(model, cfg.max_tokens, threads=n))
    return runners


PEERS: dict[str, object] = {}  # the peer runtimes loaded so far (transformers, llama.cpp), reused across batches


def _hf_runner(name: str, cfg: BenchConfig, batch_size: int) -> Runner | None:
    from specpool.bench import peers

    if "target" not in PEERS:
        PEERS["target"] = peers.load_hf_target(cfg.model_path)
    hf = PEERS["target"]
    if name == "hf-ar":
        return _hf(lambda p, sp: peers.hf_generate(
            hf, p, cfg.max_tokens, batch_size=batch_size, temperature=sp.temperature, seed=sp.seed))
    if batch_size != 1:
        return None  # transformers runs prompt lookup and assisted generation at batch 1 only
    if name == "hf-prompt-lookup":
        return _hf(lambda p, sp: peers.hf_prompt_lookup(
            hf, p, cfg.max_tokens, num_tokens=10, temperature=sp.temperature, seed=sp.seed))
    if name == "hf-assisted":
        if "draft" not in PEERS:
            PEERS["draft"] = peers.load_hf_draft(cfg.draft_dir, cfg.model_path)
        draft = PEERS["draft"]
        return _hf(lambda p, sp: peers.hf_assisted(
            hf, draft, p, cfg.max_tokens, temperature=sp.temperature, seed=sp.seed))
    raise ValueError(f"unknown mode {name!r}")


def _llamacpp_runner(cfg: BenchConfig, batch_size: int, lookup: int) -> Runner:
    """llama.cpp decoding each chunk's prompts as one batch of sequences on the bench's threads."""
    from specpool.bench.llamacpp_peer import LlamaCpp

    if PEERS.get("llamacpp_batch") != batch_size:  # one context per batch size: its sequence count
        if "llamacpp" in PEERS:
            PEERS["llamacpp"].close()
        PEERS["llamacpp"] = LlamaCpp(cfg.model_path, torch.get_num_threads(), sequences=batch_size)
        PEERS["llamacpp_batch"] = batch_size
    llm = PEERS["llamacpp"]
    return _hf(lambda p, sp: llm.generate(p, cfg.max_tokens, sp.temperature, sp.seed, lookup=lookup))


def _llamacpp_sd_runner(cfg: BenchConfig, batch_size: int, draft_max: int) -> Runner | None:
    """llama.cpp's own draft-model speculation (llama-speculative-simple, bench/llamacpp_spec.py), prompt by
    prompt with the target and --draft GGUF files on the bench's threads; greedy, batch 1 only."""
    from specpool.bench.llamacpp_spec import LlamaCppSpeculative

    if batch_size != 1:
        return None  # the binary decodes one sequence
    if cfg.temperature != 0:
        raise ValueError("llamacpp-sd runs greedy only: pass --temperature 0 or leave the mode out")
    if draft_max < 1:
        raise ValueError(f"llamacpp-sd:N drafts N >= 1 tokens a step, not {draft_max}")
    if cfg.draft_dir is None or cfg.draft_dir.suffix != ".gguf" or not cfg.draft_dir.is_file():
        raise FileNotFoundError(f"llamacpp-sd needs --draft to be a GGUF model file sharing the target's tokenizer "
                                f"(e.g. --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b); got {cfg.draft_dir}")
    if "llamacpp-sd" not in PEERS:
        PEERS["llamacpp-sd"] = LlamaCppSpeculative(cfg.model_path, cfg.draft_dir, torch.get_num_threads())
    sd = PEERS["llamacpp-sd"]

    def run(prompts, params, totals):
        out = sd.generate(prompts, cfg.max_tokens, draft_max)
        reports = sd.runs[-len(prompts):]
        totals.seconds += out.seconds
        totals.new_tokens += out.new_tokens
        totals.outputs.extend(out.token_ids)
        totals.drafted += sum(r.n_drafted for r in reports)
        # Each target step keeps its accepted drafts and one token of its own, the first token included.
        totals.target_steps = (totals.target_steps or 0) + sum(r.target_steps for r in reports)

    return run
