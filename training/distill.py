"""Distil a small Llama draft from the target: soft labels from the target's cached top-k.

The draft shares the target's tokenizer and input embeddings (read from the target GGUF at load
time, so the checkpoint does not carry them), starts from a few of the target's layers, and
scores a reduced vocabulary: the tokens the target actually produces, mapped back to full ids.
Its layers are the runtime's (engine/runtime/layer.py: RoPE on adjacent pairs, the family's q/k/v biases and
q/k norms), so the exported weights load into `specpool.engine.runtime.model.Llama` unchanged.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specpool.engine.runtime.config import ModelConfig, layer_shapes
from specpool.engine.runtime.draft_pair import embedding_probe
from specpool.engine.runtime.layer import Attention, layer, trainable_weights
from specpool.engine.runtime.rope import rope_angles
from specpool.training.draft_data import Corpus


def reduced_vocab(token_lists: Iterable[Sequence[int]], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the lists, `always` included; sorted ids."""
    counts: Counter[int] = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    keep = set(always)
    for tok, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(tok)
    return torch.tensor(sorted(keep), dtype=torch.long)


def add_output_and_rope(module: nn.Module, config: ModelConfig, norm: torch.Tensor, lm_head: torch.Tensor) -> None:
    """A trainable draft's final norm and reduced head (from the target's), and its RoPE tables."""
    module.norm = nn.Parameter(norm.clone().float())
    module.lm_head = nn.Parameter(lm_head.clone().float())  # [Vd, d]
    angles = rope_angles(config)
    module.register_buffer("cos", angles.cos().float(), persistent=False)
    module.register_buffer("sin", angles.sin().float(), persistent=False)


def causal_attention(config: ModelConfig) -> Attention:
    """Attention over the whole fed sequence, each query seeing itself and the positions before it (within
    a sliding window where the model has one, as the runtime's cache attention does)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[1]
        mask = None
        if config.windowed and T > config.sliding_window:
            pos = torch.arange(T, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - config.sliding_window)  # [T, T]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, is_causal=mask is None, enable_gqa=True).transpose(1, 2)

    return attend


class DraftLM(nn.Module):
    def __init__(self, config: ModelConfig, embed: torch.Tensor, blocks: list[dict], norm, lm_head, output_ids):
        super().__init__()
        self.config = config
        self.register_buffer("embed", embed.float(), persistent=False)  # frozen, shared with the target
        self.register_buffer("output_ids", output_ids)
        self.blocks = nn.ModuleList(
            nn.ParameterDict({n: nn.Parameter(w.clone().float()) for n, w in b.items()}) for b in blocks)
        add_output_and_rope(self, config, norm, lm_head)

    @classmethod
    def from_target(cls, target_cfg: ModelConfig, target_weights: dict, layer_ids: list[int], output_ids):
        config = ModelConfig(**(asdict(target_cfg) | {"n_layers": len(layer_ids), "tie_embeddings": False}))
        blocks = [{n: target_weights[f"layers.{i}.{n}"] for n in layer_shapes(target_cfg)} for i in layer_ids]
        embed = target_weights["embed"]
        return cls(config, embed, blocks, target_weights["norm"], embed[output_ids], output_ids)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits over the reduced vocabulary [B, T, Vd] (causal, no cache)."""
        cfg = self.config
        T = tokens.shape[1]
        angles = (self.cos[:T, None, :], self.sin[:T, None, :])  # [T, 1, D/2]
        x, attend = F.embedding(tokens, self.embed), causal_attention(cfg)
        for blk in self.blocks:
            x = layer(x, trainable_weights(blk, cfg), cfg, angles, attend)
        return F.rms_norm(x, (cfg.d_model,), self.norm, cfg.norm_eps) @ self.lm_head.T

    def runtime_weights(self) -> dict[str, torch.Tensor]:
        """Weights under engine.model.Llama's names (embeddings excluded: they come from the target)."""
        out = {"norm": self.norm, "lm_head": self.lm_head, "output_ids": self.output_ids}
        for i, blk in enumerate(self.blocks):
            out |= {f"layers.{i}.{n}": p for n, p in blk.items()}
        return {k: v.detach().contiguous() for k, v in out.items()}


def export(model: DraftLM, out_dir: Path, target_file: str, dtype=torch.bfloat16) -> None:
    """models/<name>/: model.safetensors (bf16 weights, int64 output_ids) and config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v if k == "output_ids" else v.to(dtype)) for k, v in model.runtime_weights().items()}
    tensors |= embedding_probe(model.embed, model.output_ids)  # how a load tells the target from another model
    save_file(tensors, str(out_dir / "model.safetensors"))
    meta = {"config": asdict(model.config), "embeddings_from": target_file, "draft_vocab": len(model.output_ids)}
    (out_dir / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


class Batches:
    """Windows of the corpus, with soft teacher targets mapped into the draft vocabulary."""

    def __init__(self, corpus: Corpus, output_ids: torch.Tensor, vocab_size: int, window: int, seed: int):
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_draft[output_ids] = torch.arange(len(output_ids))
        self.windows = [
            (i, s) for i, seq in enumerate(corpus.sequences) for s in range(0, max(1, len(seq) - 1), window)
        ]
        self.corpus, self.window, self.rng = corpus, window, random.Random(seed)

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, T], target ids [B, T, k] (draft ids, -1 = none), target probs [B, T, k], mask [B, T]."""
        picks = self.rng.sample(self.windows, batch)
        T = max(min(self.window, len(self.corpus.sequences[i]) - s) for i, s in picks)
        k = self.corpus.teacher_ids[0].shape[1]
        tokens = torch.zeros(batch, T, dtype=torch.long)
        ids = torch.full((batch, T, k), -1, dtype=torch.long)
        probs = torch.zeros(batch, T, k)
        mask = torch.zeros(batch, T, dtype=torch.bool)
        for b, (i, s) in enumerate(picks):
            seq = self.corpus.sequences[i][s : s + T]
            n = len(seq)
            tokens[b, :n] = torch.tensor(seq)
            ids[b, :n] = self.to_draft[self.corpus.teacher_ids[i][s : s + n].long()]
            probs[b, :n] = self.corpus.teacher_logprobs[i][s : s + n].float().exp()
            mask[b, :n] = True
        probs = probs * (ids >= 0)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
        return tokens, ids.clamp(min=0), probs, mask & (probs.sum(-1) > 0)


def distill_loss(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor):
    """Cross-entropy against the teacher's renormalised top-k (KL up to a constant); -> (loss, top-1 agreement)."""
    logp = logits.float().log_softmax(-1).gather(-1, ids)  # [B, T, k]
    per_pos = -(probs * logp).sum(-1)  # [B, T]
    loss = per_pos[mask].mean()
    agree = (logits.argmax(-1) == ids[..., 0])[mask].float().mean()
    return loss, agree


# One optimiser step's loss: -> (loss, top-1 agreement, tokens it covered).
StepLoss = Callable[[], tuple[torch.Tensor, torch.Tensor, int]]


def distill_step(model: DraftLM, batches: Batches, batch_size: int, bf16_autocast: bool) -> StepLoss:
    def step():
        tokens, ids, probs, mask = batches.sample(batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            logits = model(tokens)
        return (*distill_loss(logits, ids, probs, mask), int(mask.sum()))

    return step


def train(
    model: nn.Module,
    step_loss: StepLoss,
    seconds: float,
    ckpt_path: Path,
    lr: float = 1e-3,
    checkpoint_every_s: float = 120.0,
    desc: str = "distil (s)",
    evaluate: Callable[[], object] | None = None,
) -> dict:
    """Train for a wall-clock budget (resumable); the LR follows warm-up then cosine over that budget.
    With `evaluate`, each checkpoint appends (training tokens, its result) to state["evaluations"]:
    the learning curve."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    state = {"elapsed": 0.0, "step": 0, "tokens": 0, "history": [], "evaluations": []}
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed from {ckpt_path}: step {state['step']}, {state['elapsed']:.0f}s trained")

    def save():
        if evaluate is not None:
            model.eval()
            state.setdefault("evaluations", []).append((state["tokens"], evaluate()))
            model.train()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)

    bar = tqdm(total=int(seconds), initial=int(state["elapsed"]), desc=desc, unit="s")
    last_ckpt = time.monotonic()
    ema_loss = ema_agree = None
    while state["elapsed"] < seconds:
        t0 = time.monotonic()
        progress = state["elapsed"] / seconds
        warm = min(1.0, (state["step"] + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        loss, agree, n_tokens = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

        state["step"] += 1
        state["tokens"] += n_tokens
        state["elapsed"] += time.monotonic() - t0
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        ema_agree = agree.item() if ema_agree is None else 0.98 * ema_agree + 0.02 * agree.item()
        if state["step"] % 50 == 0:
            state["history"].append((state["step"], round(state["elapsed"]), round(ema_loss, 4), round(ema_agree, 4)))
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{ema_loss:.3f}", top1=f"{ema_agree:.3f}", tokens=state["tokens"])
        if time.monotonic() - last_ckpt > checkpoint_every_s:
            save()
            last_ckpt = time.monotonic()
    bar.close()
    save()
    return state
