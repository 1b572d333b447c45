"""`specpool train-draft --kind head`: the feature-fed draft head, resumable at every stage.

Stages write into --work-dir: prompts.pt (code and chat prompts), features/shard-*.pt (the target's
answers with its features at every position) and head_train.pt (head, optimiser and clock).
Re-running with the same --work-dir resumes where it stopped; a larger --data-minutes or
--train-minutes continues the same data pass or the same head.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specpool.bench.workloads import CHAT
from specpool.common.machine import machine_info
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.runtime.device import native_bf16
from specpool.engine.runtime.gguf_loader import model_name
from specpool.engine.runtime.hf_loader import load_model_file
from specpool.engine.runtime.model import Llama
from specpool.training.distill import reduced_vocab, train
from specpool.training.draft_data import (
    build_prompts,
    chat_prompts,
    documented_functions,
    generated_instructions,
    installed_functions,
    module_prose,
    python_roots,
    stdlib_functions,
)
from specpool.training.head import FeatureWindows, HeadLM, export, head_step, output_rows
from specpool.training.head_data import FeatureCorpus, record_features
from specpool.training.train_draft import HELD_OUT, acceptance_rows, measure_acceptance, save_report


def head_prompts(target: Llama, tokenizer, work_dir: Path, seed: int, generated: int = 1200,
                 roots: tuple[Path, ...] | None = None) -> list[list[int]]:
    """Code prompts (documented functions of the stdlib and the installed packages, or of `roots`) and chat
    prompts (requests the target writes itself, templates, tasks over module docs), alternating while both
    last; built once and kept in work_dir."""
    path = work_dir / "prompts.pt"
    if path.exists():
        return torch.load(path)
    if roots is None:
        roots, functions = python_roots(), stdlib_functions() + installed_functions()
    else:
        functions = [f for root in roots for f in documented_functions(root, max_source_chars=1500)]
    code = build_prompts(functions, tokenizer, seed)
    prose = [t for root in roots for t in module_prose(root)]
    held_out = {m["content"] for item in map(json.loads, CHAT.read_text().splitlines()) for m in item["messages"]}
    asks = generated_instructions(target, tokenizer, generated, seed)
    chat = chat_prompts(tokenizer, seed, prose, held_out, asks)
    # Alternate, so that any prefix of the list (a time budget's worth) holds as much chat as code.
    prompts = [p for pair in zip(code, chat) for p in pair] + code[len(chat):] + chat[len(code):]
    torch.save(prompts, path)
    print(f"{len(prompts)} prompts: {len(code)} code, {len(chat)} chat")
    return prompts


def feature_corpus(target: Llama, tokenizer, cfg: TrainHeadConfig) -> tuple[FeatureCorpus, list[list[int]]]:
    """-> (the target's answers to the training prompts with its features, the held-out prompts)."""
    prompts = head_prompts(target, tokenizer, cfg.work_dir, cfg.seed, cfg.generated_requests, cfg.prompt_roots)
    # Each prompt must leave its answer room in the target's context (a short one, or a long prompt).
    prompts = [p for p in prompts if len(p) + cfg.max_new_tokens < target.config.max_context]
    held_out, train_prompts = prompts[:HELD_OUT], prompts[HELD_OUT:]
    corpus = record_features(target, train_prompts, cfg.work_dir / "features", cfg.data_minutes * 60, cfg.gen_batch,
                             cfg.max_new_tokens, cfg.seed)
    print(f"features: {len(corpus.sequences)} sequences, {corpus.num_tokens} tokens, "
          f"{corpus.tokens_per_hour / 1e6:.2f}M tokens an hour")
    return corpus, held_out


@dataclass(frozen=True, slots=True)
class TrainHeadConfig:
    # A deliberate parallel of TrainDraftConfig: the fields both share mean the same (the CLI fills either).
    target: Path
    out: Path
    work_dir: Path
    data_minutes: float = 50.0
    train_minutes: float = 30.0
    draft_vocab: int = 8192
    max_new_tokens: int = 192
    gen_batch: int = 32
    train_batch: int = 8
    window: int = 256
    unrolled_steps: int = 3  # drafting steps simulated in training (EAGLE-3's training-time test)
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "auto"  # the target's in the data pass: the serving default, whose features the head reads
    generated_requests: int = 1200  # chat requests the target writes itself (draft_data.generated_instructions)
    prompt_roots: tuple[Path, ...] | None = None  # the prompts' Python sources; None: the stdlib and installed packages


def check_work_dir(work_dir: Path, target: Path, config) -> None:
    """A work dir holds one target's prompts (its token ids) and features: resuming it with another target is
    refused, naming both. The first run records its target."""
    path = work_dir / "target.json"
    ours = {"target": model_name(target), "vocab_size": config.vocab_size, "d_model": config.d_model}
    if not path.exists():
        path.write_text(json.dumps(ours) + "\n")
        return
    theirs = json.loads(path.read_text())
    if theirs != ours:
        raise ValueError(f"{work_dir} holds the data of {theirs}, not of the target {target} ({ours}): "
                         "pass another --work-dir")


@torch.no_grad()
def heldout_agreement(head: HeadLM, corpus: FeatureCorpus, lm_head: torch.Tensor, norm: torch.Tensor,
                      window: int, steps: int) -> list[float]:
    """Top-1 agreement with the target's full-vocabulary argmax, per drafting step, over every window
    of the corpus: step j drafts from an anchor j-1 positions back."""
    windows = FeatureWindows(corpus, window, seed=0)
    hits, counts = [0] * steps, [0] * steps
    for i in range(0, len(windows.windows), 8):
        tokens, feats, nxt, mask = windows.take(windows.windows[i : i + 8])
        target = (F.rms_norm(nxt, (nxt.shape[-1],), norm.float(), head.config.norm_eps) @ lm_head.float().T).argmax(-1)
        for j, predicted in enumerate(head.unrolled(tokens, feats, steps)):
            m = mask.clone()
            m[:, :j] = False
            drafted = head.output_ids[head.logits(predicted).argmax(-1)]
            hits[j] += int((drafted == target)[m].sum())
            counts[j] += int(m.sum())
    return [round(h / max(c, 1), 4) for h, c in zip(hits, counts)]


def run(cfg: TrainHeadConfig) -> dict:
    torch.manual_seed(cfg.seed)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    target, tokenizer = Llama.from_path(cfg.target, dtype=cfg.dtype, device="cpu")  # a GGUF or a HF directory
    if tokenizer is None:
        raise ValueError(f"{cfg.target} has no vocabulary (a GGUF's tokens, a directory's tokenizer.json): "
                         "the head's data pass writes its prompts with the target's tokenizer")
    check_work_dir(cfg.work_dir, cfg.target, target.config)
    corpus, held_out = feature_corpus(target, tokenizer, cfg)
    full = load_model_file(cfg.target)
    # Control tokens (chat turn markers) and stop tokens stay draftable, however rare in the corpus.
    always = sorted({*target.config.stop_ids, *(i for t in tokenizer.control_tokens for i in tokenizer.encode(t))})
    output_ids = reduced_vocab(corpus.sequences, cfg.draft_vocab, always=always)
    head = HeadLM.from_target(full.config, full.weights, output_ids)
    eval_corpus, train_corpus = corpus.split(max(1, len(corpus.sequences) // 20))
    bf16 = native_bf16("cpu")  # mixed precision only where the CPU computes bf16 natively
    step = head_step(head, FeatureWindows(train_corpus, cfg.window, cfg.seed), cfg.train_batch, cfg.unrolled_steps,
                     bf16_autocast=bf16)

    def agreement(corpus: FeatureCorpus) -> list[float]:
        return heldout_agreement(head, corpus, output_rows(full.config, full.weights), full.weights["norm"],
                                 cfg.window, cfg.unrolled_steps)

    curve_corpus, _ = eval_corpus.split(64)  # the learning curve's checkpoints: a quick subset
    state = train(head, step, cfg.train_minutes * 60, cfg.work_dir / "head_train.pt", lr=cfg.lr, desc="head (s)",
                  evaluate=lambda: agreement(curve_corpus))
    export(head, cfg.out, model_name(cfg.target))

    runtime = Llama.from_draft_checkpoint(cfg.out, full.weights["embed"], dtype="fp32", device="cpu", target=cfg.target)
    # Half the answer budget (96 tokens by default): held-out prompts fit with room for the drafts.
    new_tokens = cfg.max_new_tokens // 2
    acceptance = [measure_acceptance(target, HeadDrafter(runtime, 16, 1024), held_out[:16], k, new_tokens)
                  for k in (2, 4, 6)]
    report = {
        "target": model_name(cfg.target),
        "kind": "head",
        "draft_vocab": len(output_ids),
        "corpus_sequences": len(corpus.sequences),
        "corpus_tokens": corpus.num_tokens,
        "data_seconds": round(corpus.seconds),
        "data_tokens_per_hour": round(corpus.tokens_per_hour),
        "machine": machine_info(),
        "heldout_sequences": len(eval_corpus.sequences),
        "train_steps": state["step"],
        "train_tokens": state["tokens"],
        "train_seconds": round(state["elapsed"]),
        "heldout_top1_agreement_by_step": agreement(eval_corpus),
        "learning_curve": state.get("evaluations", []),  # (training tokens, agreement by step) at checkpoints
        "bf16_autocast": bf16,
        "heldout_acceptance_greedy": acceptance,
        "heldout_new_tokens": new_tokens,
        "history": state["history"],
        "config": json.loads(json.dumps(asdict(cfg), default=str)),  # paths as text
        "wall_seconds_this_run": round(time.monotonic() - started),
    }
    return save_report(report, cfg.out, write_card)


def write_card(report: dict, path: Path) -> None:
    rows = acceptance_rows(report)
    agree = ", ".join(f"step {j + 1}: {a:.1%}" for j, a in enumerate(report["heldout_top1_agreement_by_step"]))
    c = report["config"]
    curve = "; ".join(f"{tokens}: " + ", ".join(f"{a:.1%}" for a in by_step)
                      for tokens, by_step in report.get("learning_curve", []))
    m = report.get("machine", {})
    machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('cpu_capability', '?')}, " + (
        "native bf16" if m.get("native_bf16") else "no native bf16")
    path.write_text(f"""# Feature-fed draft head for {report['target']}

An EAGLE-style head trained by `specpool train-draft --kind head` (training/head.py): one Llama
decoder layer over the token's embedding and the target's last hidden state (its features), fused by
a linear layer; it predicts the next feature, and the target's final norm with a reduced head of
{report['draft_vocab']} tokens (mapped back to full ids) turns that into a draft. Past its first
draft it reads its own predicted features. It shares the target's tokenizer and input embeddings
(read from the target's model file at load time).

- **Init**: the target's last layer, final norm and head rows; the fusing layer at random.
- **Data**: the target's own answers (greedy, and sampled at T=0.8, top-p 0.95), decoded 32 at a
  time in its default format ({c['dtype']}), to code prompts (documented functions of the stdlib and
  the installed packages) alternating with chat prompts (requests the target wrote itself, templates
  over everyday subjects, tasks over module docs; no benchmark workload), and the target's features
  at every position, taken from those same forwards: {report['corpus_sequences']} sequences,
  {report['corpus_tokens']} tokens in {report.get('data_seconds', 0)} s ({report.get('data_tokens_per_hour', 0) / 1e6:.2f}M tokens an hour).
- **Training**: soft cross-entropy to the target's distribution (recomputed from its stored
  features, over the reduced vocabulary) at each of {c['unrolled_steps']} unrolled drafting steps, weighted
  0.8^step; AdamW lr {c['lr']}, batch {c['train_batch']} x {c['window']}, {report['train_steps']} steps,
  {report['train_tokens']} tokens, {report['train_seconds']} s on a 2-core CPU{' (bf16 autocast)' if report.get('bf16_autocast') else ''}.
- **Held-out** ({report['heldout_sequences']} sequences, 5%): top-1 agreement with the target's
  full-vocabulary argmax, {agree}.
- **Learning curve** (held-out subset, at each checkpoint: training tokens, then agreement at
  steps 1-{c['unrolled_steps']}): {curve}.
- **Machine**: {machine}.

Greedy speculative decoding (chains) on 16 held-out prompts (code and chat), {report.get('heldout_new_tokens', 96)} new tokens, the
target in its default format:

| K | tokens per target step (bonus incl.) | accepted / drafted | output equals AR |
|---|---|---|---|
{rows}

Reproduce: `specpool train-draft --kind head --model {c['target']} --out {c['out']} --data-minutes {c['data_minutes']} --train-minutes {c['train_minutes']}`
""")
