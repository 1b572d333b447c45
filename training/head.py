"""Train a feature-fed draft head (EAGLE style) on the target's cached features.

The head is one Llama decoder layer whose input at position p fuses the embedding of token p+1 with
the target's feature at p (its last hidden state before the final norm); its output predicts the
feature at p+1, and the target's final norm plus a reduced-vocabulary head turn that into the next
token. Past its first step the head drafts from its own predicted features, so training unrolls it
the same way ("training-time test", EAGLE-3): step j's input feature at p is step j-1's output at
p-1, and its attention sees the true prefix up to the anchor plus the predicted positions since.
The soft labels are the target's own distributions, recomputed from the stored features.
Its math is the runtime's (engine/runtime/model.py with `feature_fed`; its layer is engine/runtime/layer.py's),
so the exported weights load into `specpool.engine.runtime.model.Llama` unchanged.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specpool.engine.runtime.config import ModelConfig, layer_shapes
from specpool.engine.runtime.draft_pair import embedding_probe
from specpool.engine.runtime.layer import Attention, layer, trainable_weights
from specpool.training.distill import StepLoss, add_output_and_rope
from specpool.training.head_data import FeatureCorpus


def output_rows(config: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target's LM head [V, d]: its input embeddings where it ties them (SmolLM2, Llama 3.2 1B)."""
    return weights["embed" if config.tie_embeddings else "lm_head"]


def steps_attention(keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> Attention:
    """Attention of one unrolled step over every step's keys so far: appends this step's K and V [B, Hkv, P, D]
    to `keys` and `values`; mask [P, (j+1) P] says which of them each query sees."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys.append(k.transpose(1, 2))
        values.append(v.transpose(1, 2))
        return F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 2), torch.cat(values, 2),
                                              attn_mask=mask, enable_gqa=True).transpose(1, 2)

    return attend


class HeadLM(nn.Module):
    def __init__(self, config: ModelConfig, embed: torch.Tensor, block: dict[str, torch.Tensor],
                 norm: torch.Tensor, lm_head: torch.Tensor, output_ids: torch.Tensor, seed: int = 0):
        super().__init__()
        d = config.d_model
        self.config = config
        self.register_buffer("embed", embed.float(), persistent=False)  # frozen, shared with the target
        self.register_buffer("output_ids", output_ids)
        # The target's norm and head rows, frozen: the teacher's distribution from a stored feature.
        self.register_buffer("teacher_norm", norm.float().clone(), persistent=False)
        self.register_buffer("teacher_head", lm_head.float().clone(), persistent=False)
        gen = torch.Generator().manual_seed(seed)
        self.fc = nn.Parameter(torch.randn(d, 2 * d, generator=gen) * (2 * d) ** -0.5)
        self.embed_norm = nn.Parameter(torch.ones(d))
        self.feature_norm = nn.Parameter(torch.ones(d))
        self.block = nn.ParameterDict({n: nn.Parameter(w.clone().float()) for n, w in block.items()})
        add_output_and_rope(self, config, norm, lm_head)

    @classmethod
    def from_target(cls, target_cfg: ModelConfig, target_weights: dict, output_ids: torch.Tensor) -> HeadLM:
        """One layer initialised from the target's last; norm and head rows from the target's."""
        config = ModelConfig(**(asdict(target_cfg) | {"n_layers": 1, "tie_embeddings": False, "feature_fed": True}))
        last = target_cfg.n_layers - 1
        block = {n: target_weights[f"layers.{last}.{n}"] for n in layer_shapes(target_cfg)}
        lm_head = output_rows(target_cfg, target_weights)[output_ids]
        return cls(config, target_weights["embed"], block, target_weights["norm"], lm_head, output_ids)

    def teacher_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's logits over the reduced vocabulary, from its features [..., d]."""
        cfg = self.config
        return F.rms_norm(features, (cfg.d_model,), self.teacher_norm, cfg.norm_eps) @ self.teacher_head.T

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, P] (token p+1 of the window at p), features [B, P, d] (the target's at p) -> the
        predicted features [B, P, d] of each of `steps` drafting steps; step j's row p predicts the
        feature at p+1 from an anchor j-1 positions back."""
        cfg = self.config
        P = tokens.shape[1]
        angles = (self.cos[:P, None, :], self.sin[:P, None, :])  # [P, 1, D/2]
        weights = trainable_weights(self.block, cfg)
        emb = F.rms_norm(F.embedding(tokens, self.embed), (cfg.d_model,), self.embed_norm, cfg.norm_eps)
        pos = torch.arange(P)
        # Each step's key at column c sits at position c: a sliding window (Mistral) hides those too far back.
        in_window = pos[None, :] > pos[:, None] - (cfg.sliding_window if cfg.windowed else P)  # [P, P]
        keys, values, outputs = [], [], []
        feed = features
        for j in range(steps):
            x = torch.cat([emb, F.rms_norm(feed, (cfg.d_model,), self.feature_norm, cfg.norm_eps)], -1) @ self.fc.T
            # Query (j, p), anchored at a = p - j: the true prefix up to a, and step s's entry at a + s.
            anchor = pos[:, None] - j
            visible = [pos[None, :] <= anchor] + [pos[None, :] == anchor + s for s in range(1, j + 1)]
            mask = torch.cat(visible, 1) & in_window.repeat(1, j + 1)
            x = layer(x, weights, cfg, angles, steps_attention(keys, values, mask))
            outputs.append(x)
            # The next step's feature at p is this step's prediction made at p - 1.
            feed = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        return outputs

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return F.rms_norm(predicted, (cfg.d_model,), self.norm, cfg.norm_eps) @ self.lm_head.T

    def runtime_weights(self) -> dict[str, torch.Tensor]:
        """Weights under engine.model.Llama's names (embeddings excluded: they come from the target)."""
        out = {"norm": self.norm, "lm_head": self.lm_head, "output_ids": self.output_ids, "fc": self.fc,
               "embed_norm": self.embed_norm, "feature_norm": self.feature_norm}
        out |= {f"layers.0.{n}": p for n, p in self.block.items()}
        return {k: v.detach().contiguous() for k, v in out.items()}


def export(model: HeadLM, out_dir: Path, target_file: str, dtype=torch.bfloat16) -> None:
    """models/<name>/: model.safetensors (bf16 weights, int64 output_ids) and config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v if k == "output_ids" else v.to(dtype)) for k, v in model.runtime_weights().items()}
    tensors |= embedding_probe(model.embed, model.output_ids)  # how a load tells the target from another model
    save_file(tensors, str(out_dir / "model.safetensors"))
    meta = {"config": asdict(model.config), "embeddings_from": target_file, "draft_vocab": len(model.output_ids),
            "kind": "head"}
    (out_dir / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


class FeatureWindows:
    """Windows of the feature corpus: tokens and features of up to `window` positions."""

    def __init__(self, corpus: FeatureCorpus, window: int, seed: int):
        self.windows = [(i, s) for i, seq in enumerate(corpus.sequences) for s in range(0, max(1, len(seq) - 2), window)]
        self.corpus, self.window, self.rng = corpus, window, random.Random(seed)

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> input tokens [B, P] (token p+1), input features [B, P, d] (at p), target features [B, P, d]
        (at p+1), mask [B, P]."""
        return self.take(self.rng.sample(self.windows, batch))

    def take(self, picks: list[tuple[int, int]]):
        c = self.corpus
        n = [min(self.window + 1, len(c.sequences[i]) - s) for i, s in picks]
        P = max(n) - 1
        d = c.features[0].shape[1]
        tokens = torch.zeros(len(picks), P, dtype=torch.long)
        feats = torch.zeros(len(picks), P, d)
        nxt = torch.zeros(len(picks), P, d)
        mask = torch.zeros(len(picks), P, dtype=torch.bool)
        for b, ((i, s), m) in enumerate(zip(picks, n)):
            tokens[b, : m - 1] = torch.tensor(c.sequences[i][s + 1 : s + m])
            f = c.features[i][s : s + m].float()
            feats[b, : m - 1], nxt[b, : m - 1] = f[:-1], f[1:]
            mask[b, : m - 1] = True
        return tokens, feats, nxt, mask


def head_losses(model: HeadLM, tokens, feats, nxt, mask, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Soft cross-entropy to the target's distribution at each unrolled step (weights 0.8^j, EAGLE-3's);
    -> (loss, top-1 agreement per step). Step j scores the positions with an anchor (p >= j)."""
    teacher = model.teacher_logits(nxt).float().softmax(-1)  # [B, P, Vd]
    top = teacher.argmax(-1)
    loss, agree, weight = 0.0, [], 0.0
    for j, predicted in enumerate(model.unrolled(tokens, feats, steps)):
        m = mask.clone()
        m[:, :j] = False
        logits = model.logits(predicted).float()
        loss = loss + 0.8**j * -(teacher * logits.log_softmax(-1)).sum(-1)[m].mean()
        weight += 0.8**j
        agree.append((logits.argmax(-1) == top)[m].float().mean())
    return loss / weight, agree


def head_step(model: HeadLM, windows: FeatureWindows, batch_size: int, steps: int,
              bf16_autocast: bool = False) -> StepLoss:
    def step():
        tokens, feats, nxt, mask = windows.sample(batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            loss, agree = head_losses(model, tokens, feats, nxt, mask, steps)
        return loss, agree[0], int(mask.sum())

    return step
