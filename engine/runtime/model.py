"""Llama forward over the slot-indexed KV cache.

One `forward` serves prefill, 1-token decode and (K+1)-token verify steps for ragged batches:
row b feeds `tokens[b]` (any length) to the sequence in `slots[b]`, whose cached length gives
its start position. Rows are right-padded to a common width; padded positions write their K/V
into a scratch slot, so they never touch a live sequence. Where the tokens go and what each sees is
engine/runtime/step_layout.py's; the block each layer runs is engine/runtime/layer.py's.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from specpool.engine.runtime.config import ModelConfig
from specpool.engine.runtime.device import default_device, draft_format, resolve_format
from specpool.engine.runtime.draft_pair import check_trained_for
from specpool.engine.runtime.gguf_loader import QuantizedBlocks, release_file_pages
from specpool.engine.runtime.kv_cache import KVCache
from specpool.engine.runtime.layer import block_weights, layer
from specpool.engine.runtime.linear import BlockEmbedding, BlockLinear, Int4Linear, Linear, StackedBlockLinear
from specpool.engine.runtime.process_env import release_freed_heap
from specpool.engine.runtime.rope import rope_angles
from specpool.engine.runtime.row_check import row_mismatch
from specpool.engine.runtime.step_layout import StepLayout, check_rows

log = logging.getLogger(__name__)

class Llama:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: str | torch.dtype | None, device,
                 blocks: dict[str, QuantizedBlocks] | None = None):
        """`blocks`: the GGUF's quantized matrices (GGUFModel.blocks), read by the int4 format."""
        self.config = config
        self.fingerprint = weights_fingerprint(config, weights)
        self.device = torch.device(device)
        self.forwards = 0  # forward calls so far (a pooled drafter's metrics count its model's)
        four_bit = any(b.four_bit for b in (blocks or {}).values())
        self.format = resolve_format(dtype, self.device, four_bit)  # bf16 only where native; q4 where fast
        self._build(weights, blocks)
        release_freed_heap()  # the build's temporaries, before the row check's own
        # Lossless against its own AR on this machine, or the next format (engine/runtime/row_check.py). An
        # explicit dense dtype is kept and its check reported; the engine's own choices (auto, q4) fall back.
        self.format_check = "rows not checked off the CPU"
        if self.device.type == "cpu":
            while (mismatch := row_mismatch(self)) and dtype in (None, "auto", "q4") and (
                    fallback := self.format.fallback()):
                log.warning("%s: %s on this CPU, so it runs as %s", self.format.label, mismatch, fallback.label)
                self.format = fallback
                self._build(weights, blocks)
            self.format_check = (f"rows differ: {mismatch}" if mismatch
                                 else "decode, verify, tree and batch rows bit-identical")

    @property
    def format_label(self) -> str:
        """What a target reports: its format and the start-up check that format passed."""
        return f"{self.format.label}: {self.format_check}"

    def _build(self, weights: dict[str, torch.Tensor], blocks: dict[str, QuantizedBlocks] | None) -> None:
        """The model's tensors and matrices in `self.format`."""
        config = self.config
        self.dtype = dtype = self.format.dtype
        blocks = blocks if self.format.int4 else {}

        def w(name: str, dtype: torch.dtype = dtype) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def linear(*names: str) -> Linear | Int4Linear | BlockLinear | StackedBlockLinear:
            """`product`, then the file's pages it read let go (they stayed resident beside the repacked copy)."""
            matrix = product(*names)
            for n in names:
                if n in blocks:
                    release_file_pages(blocks[n].data)
            return matrix

        def product(*names: str) -> Linear | Int4Linear | BlockLinear | StackedBlockLinear:
            """One matrix over these weights stacked along their outputs: the int4 kernel on the file's
            blocks where every part has blocks it reads, else dense."""

            def dense() -> Linear:
                return Linear(torch.cat([w(n, self.format.dense_dtype) for n in names]) if len(names) > 1
                              else w(names[0], self.format.dense_dtype))

            parts = [blocks.get(n) for n in names]
            if all(p is not None for p in parts) and len({p.kind for p in parts}) == 1:
                stacked = QuantizedBlocks.cat(parts) if len(parts) > 1 else parts[0]
                if self.format.own_kernels and BlockLinear.supports(stacked):
                    return BlockLinear(stacked, prefill=dense() if dense_prefill else None)
                if Int4Linear.supports(stacked):
                    return Int4Linear.from_blocks(stacked, prefill=dense())
            elif self.format.own_kernels and all(p is not None and BlockLinear.supports(p) for p in parts):
                return StackedBlockLinear([BlockLinear(p) for p in parts])  # formats differ: a K-quant file's
            return dense()

        # Dense twins for prefill only where every matrix is in a format that keeps one (BlockLinear.DENSE_PREFILL).
        dense_prefill = all(b.kind in BlockLinear.DENSE_PREFILL for b in blocks.values())

        shape_of = getattr(weights, "shape_of", lambda name: weights[name].shape)  # a GGUF's: not dequantized
        if "output_ids" in weights and shape_of("lm_head")[0] != len(weights["output_ids"]):
            raise ValueError("lm_head rows must match output_ids")

        embed = blocks.get("embed")  # [V, d]: on the file's blocks where its matrices prefill on them too
        self.embed = BlockEmbedding(embed) if self.format.own_kernels and embed is not None and not dense_prefill \
            else w("embed")
        self.lm_head = linear("embed" if config.tie_embeddings else "lm_head")
        # A draft may score only a reduced vocabulary: its head row i is full-vocab token output_ids[i].
        self.output_ids = weights["output_ids"].to(self.device) if "output_ids" in weights else None
        self.norm = w("norm")
        if config.feature_fed:
            self.input_norms = torch.stack([w("embed_norm"), w("feature_norm")])  # [2, d]: one norm call for both
            self.fc = linear("fc")  # [d, 2d]: (normed embedding, normed feature) -> the layers' input

        def layer_weights(prefix: str) -> dict:
            return block_weights(lambda name: w(prefix + name), lambda *names: linear(*(prefix + n for n in names)),
                                 config)

        self.layers = [layer_weights(f"layers.{i}.") for i in range(config.n_layers)]
        # Under q4, attention runs in float64 (the cache stays fp32: each layer widens the keys it reads).
        # Its sums then round to the same fp32 whatever their order, so a query's output is the same bits
        # in a decode step, a verify step, a tree or a batch, as every other op of the q4 forward already
        # is (the int4 kernel, norms and elementwise ops work row by row). In fp32, attention kernels of
        # different shapes differ in the last ulp; the bf16 rounding of the next matmul's input turned
        # that into logit differences of up to ~0.6 between a decode step and a verify step, and greedy
        # speculation no longer equalled greedy decoding (5 of 6 prompts, 128 tokens, n-gram K=2). The
        # cost, SmolLM2-135M on 2 cores of an AVX-512 EPYC: +1.5 ms a decode step at 128 positions
        # (12.1 -> 13.7 ms), +4.6 ms at 1000.
        # With the engine's own kernels and every layer matrix on the file's blocks, decode and verify steps
        # run five fused ops a layer (`_fused_layers`), attention in fp32 over each query's exact visible
        # keys: equal bits by construction, at fp32's cost.
        # Qwen2's q/k/v biases are added to the fused product's fp32 rows, one add per element whatever the row
        # count; a stack whose parts differ in format (a Q4_K_M file's v in Q6_K) runs a product a part. The fused
        # attention knows no window start or q/k norm: such a model runs the layers below.
        generic = config.windowed or config.qk_norm
        self.fused = self.format.own_kernels and not generic and all(
            isinstance(weights[k], (BlockLinear, StackedBlockLinear))
            for weights in self.layers for k in ("wqkv", "wo", "w_gate_up", "w_down"))
        self.attention_dtype = torch.float64 if self.format.int4 and not self.fused else dtype
        # Prefill runs the dense twin in bf16 under q4, which turns the last-ulp differences of a padded
        # batch (other attention lengths, other kernel blocking) into other bf16 roundings: a HumanEval
        # prompt prefilled beside 15 others had logits 0.125 away from its own. So each prompt prefills
        # alone, and a q4 sequence's tokens are the same whatever the batch it ran in.
        self.prefill_alone = self.format.int4
        angles = rope_angles(config)
        self.rope_cos = angles.cos().to(self.device, dtype)  # [max_context, D/2]
        self.rope_sin = angles.sin().to(self.device, dtype)
        # fp32 rotates each (x[2i], x[2i+1]) pair as one complex multiply: one op where the pairwise
        # form takes seven (torch has no bf16 complex numbers, so bf16 keeps that form).
        self.rope_cis = torch.complex(self.rope_cos, self.rope_sin) if dtype == torch.float32 else None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, dtype: str | None = None, device: str | None = None):
        """Returns (model, tokenizer) for a GGUF of a supported architecture (engine/runtime/gguf_config.py);
        tokenizer is None when the file has no vocabulary (tiny test models, which are fed token ids)."""
        from specpool.engine.runtime.gguf_loader import load_gguf
        from specpool.engine.runtime.tokenizer import Tokenizer

        dev = torch.device(device) if device else default_device()
        gguf_model = load_gguf(path)
        if gguf_model.tokens and gguf_model.tokenizer_model not in (None, "gpt2", "llama"):
            # Read as byte-level BPE, another kind of vocabulary would tokenize every prompt wrong.
            from specpool.engine.runtime.hf_config import ModelFileError

            raise ModelFileError(path, "tokenizer.ggml.model", f"{gguf_model.tokenizer_model!r} is not supported (gpt2: "
                                 "byte-level BPE; llama: SentencePiece): pass the model's Hugging Face directory, "
                                 "whose tokenizer.json is read")
        model = cls(gguf_model.config, gguf_model.weights, dtype, dev, blocks=gguf_model.blocks)
        return model, (Tokenizer.from_gguf(gguf_model) if gguf_model.tokens else None)

    @classmethod
    def from_path(cls, path: str | Path, dtype: str | None = None, device: str | None = None):
        """(model, tokenizer) from a GGUF file or a Hugging Face model directory (engine/runtime/hf_loader.py);
        tokenizer is None where the file has no vocabulary."""
        from specpool.engine.runtime.hf_config import ModelFileError, read_config

        path = Path(path)
        if path.suffix in (".safetensors", ".json"):
            raise ModelFileError(path, path.name, "pass the Hugging Face model's directory, not one of its files")
        if not path.is_dir():
            return cls.from_gguf(path, dtype, device)
        from specpool.engine.runtime.hf_loader import load_hf, load_hf_tokenizer

        tokenizer = load_hf_tokenizer(path, read_config(path))  # before the weights: a bad template fails fast
        hf = load_hf(path)
        return cls(hf.config, hf.weights, dtype, torch.device(device) if device else default_device()), tokenizer

    @classmethod
    def from_draft_checkpoint(
        cls, directory: str | Path, embed: torch.Tensor, dtype: str | None = None, device: str | None = None,
        target: str | Path = "this target",
    ) -> Llama:
        """A distilled draft or head (models/<name>/): its own layers and head; `embed` is the target's
        input embedding table (`load_model_file(target, only={"embed"})`), which the checkpoint omits.
        Raises TargetMismatch (naming `target`) where the checkpoint was trained for another model."""
        import json

        from safetensors.torch import load_file

        directory = Path(directory)
        meta = json.loads((directory / "config.json").read_text())
        weights = load_file(str(directory / "model.safetensors"))
        check_trained_for(directory, meta, weights, embed, target)
        dev = torch.device(device) if device else default_device()
        dtype, block_kind = draft_format(dtype, dev)
        blocks = {name: QuantizedBlocks.quantize(t, block_kind) for name, t in weights.items()
                  if t.dim() == 2 and t.shape[1] % QuantizedBlocks.BLOCK == 0} if block_kind else None
        weights["embed"] = embed
        return cls(ModelConfig(**meta["config"]), weights, dtype, dev, blocks=blocks)

    @classmethod
    def random_init(cls, config: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu") -> Llama:
        return cls(config, random_weights(config, seed), dtype, device)

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        return KVCache(self.config, max_slots, min(max_len, self.config.max_context), self.dtype, self.device)

    # -- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        all_logits: bool = False,
        features: bool = False,
        fed_features: torch.Tensor | None = None,
        parents: Sequence[Sequence[int]] | None = None,
        prefill: bool = False,
        own_vocab: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens[b] to the sequence in slots[b]; advance its cache length.

        Returns fp32 logits: [B, V] for each row's last token, or [B, T, V] (rows padded to T)
        when `all_logits` (verify steps need a row per draft position). With `features`, also the
        last layer's hidden states before the final norm at every position, [B, T, d] in the model's
        dtype: what a feature-fed draft head reads. A feature-fed model takes `fed_features` [B, T, d], the
        feature that goes with each fed token (rows padded like the tokens).

        `parents` feeds token trees (engine/verification/token_tree.py): parents[b] is row b's whole tree so far, the
        parent of each node (-1: a child of the prefix the tree hangs from), ending with the nodes this
        call feeds (tokens[b]); the earlier ones are the row's last cached positions. A node sits at the
        position of its depth past that prefix and sees only the prefix and its ancestors; K/V are
        written in feed order (`KVCache.keep_path` moves an accepted path's into place), so a tree can
        grow over several calls. None: every row is a chain.

        `prefill`: the rows are prompts (a scheduler's prefill step, never mixed with decode rows), so
        quantized matrices run their dense twin (engine/runtime/linear.py), faster for many rows. Its logits may
        differ from the quantized kernel's in rounding; AR and speculation share the prefill, and every
        decode and verify step runs the one kernel.

        `own_vocab`: logits over the model's own output rows only, for a draft that scores a reduced
        vocabulary (`token_ids` maps a row to its token): spreading them over the whole vocabulary and
        searching that took ~0.1 ms of a head's ~0.5 ms step.
        """
        if self.config.feature_fed != (fed_features is not None):
            raise ValueError("fed_features are required by a feature-fed model, and only by one")
        cfg = self.config
        check_rows(cache, slots, tokens)
        self.forwards += 1
        if prefill and len(slots) > 1 and self.prefill_alone:
            return self._prefill_each(cache, slots, tokens, all_logits, features, fed_features)
        fused = self.fused and not prefill
        # Float64 attention makes decode and verify agree bit for bit (see __init__); a prefill need not.
        attention_dtype = self.dtype if prefill else self.attention_dtype
        step = StepLayout.of(cfg, cache, slots, tokens, parents, attention_dtype, fused, self.device)
        B, T = step.ids.shape
        x = F.embedding(step.ids, self.embed)  # [B, T, d]
        if fed_features is not None:
            feats = fed_features.to(self.device, self.dtype)
            pair = F.rms_norm(torch.stack([x, feats], -2), (cfg.d_model,), eps=cfg.norm_eps)  # [B, T, 2, d]
            x = self.fc((pair * self.input_norms).flatten(-2))
        # A short row's padding runs past its real positions, and near the end of the context past the
        # table: any angle serves a padding position (its key goes to the scratch slot).
        rope_pos = step.pos.clamp(max=self.rope_cos.shape[0] - 1)
        if fused:  # the fused attention rotates q and k itself
            cos, sin = (t[rope_pos].view(B * T, cfg.head_dim // 2) for t in (self.rope_cos, self.rope_sin))
            x = self._fused_layers(x.view(B * T, cfg.d_model), cos, sin, cache, step.visible_keys)
            x = x.view(B, T, cfg.d_model)
        else:
            angles = (self.rope_cis[rope_pos][:, :, None, :] if self.rope_cis is not None  # [B, T, 1, D/2]
                      else (self.rope_cos[rope_pos][:, :, None, :], self.rope_sin[rope_pos][:, :, None, :]))
            for li, weights in enumerate(self.layers):
                if prefill:
                    weights = {k: getattr(m, "prefill", m) for k, m in weights.items()}
                x = layer(x, weights, cfg, angles, partial(step.attend, cache, li))

        for s, n in zip(slots, step.counts):
            cache.lengths[s] += n
        hidden = x  # [B, T, d]: every position's, also when only the last logits are asked for
        if not all_logits:
            x = x[torch.arange(B, device=self.device), torch.tensor(step.counts, device=self.device) - 1]  # [B, d]
        lm_head = self.lm_head.prefill if prefill else self.lm_head
        logits = lm_head(x, self.norm, cfg.norm_eps).float()
        if self.output_ids is not None and not own_vocab:
            full = logits.new_full((*logits.shape[:-1], cfg.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.output_ids, logits)
        return (logits, hidden) if features else logits

    def _prefill_each(self, cache: KVCache, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool,
                      features: bool, fed_features: torch.Tensor | None):
        """`forward`'s prefill of several prompts, one prompt at a time (`prefill_alone`)."""
        T = max(len(t) for t in tokens)
        rows = [self.forward(cache, [s], [t], all_logits, features,
                             None if fed_features is None else fed_features[b : b + 1, : len(t)], prefill=True)
                for b, (s, t) in enumerate(zip(slots, tokens))]
        if not features:
            return _stacked(rows, T) if all_logits else torch.cat(rows)
        logits, hidden = zip(*rows)
        return (_stacked(logits, T) if all_logits else torch.cat(logits)), _stacked(hidden, T)

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Indices into `forward(own_vocab=True)`'s logits -> the tokens they score."""
        return rows if self.output_ids is None else self.output_ids[rows]

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                      visible_keys: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layers of a decode or verify step as the engine's fused kernels (engine/runtime/csrc/cpu_kernels.cpp):
        x [N, d] fp32, the step's rows flattened; cos, sin [N, D/2] their RoPE angles; visible_keys: where
        each row's K/V go and which keys it sees (`cache_attention`). -> [N, d]

        Not engine/runtime/layer.py's `layer`: one kernel here norms nothing but rotates, writes the cache and
        attends from the flat qkv, and the products add the residual and gate the MLP inside themselves, so
        no op of that block maps onto a call of this one."""
        eps = self.config.norm_eps
        for li, weights in enumerate(self.layers):
            qkv = weights["wqkv"](x, weights["attn_norm"], eps)
            if "bqkv" in weights:
                qkv += weights["bqkv"]
            attn = torch.ops.specpool.cache_attention(qkv, cos, sin, cache.k[li], cache.v[li], *visible_keys)
            x = weights["wo"](attn, residual=x)
            x = weights["w_down"](weights["w_gate_up"](x, weights["ffn_norm"], eps), silu_mul=True, residual=x)
        return x


def _stacked(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Rows [1, T_i, ...] right-padded with zeros to `length` along dim 1 -> [B, length, ...]."""
    return torch.cat([F.pad(r, (0, 0) * (r.dim() - 2) + (0, length - r.shape[1])) for r in rows])


def weights_fingerprint(config: ModelConfig, weights: dict[str, torch.Tensor], sample: int = 1024) -> str:
    """A short digest of what the weights are: the config, each tensor's name and shape, and `sample`
    evenly spaced values of it. Two checkpoints trained apart differ in nearly every value, so this tells
    them apart where a file or directory name does not (a retrained head saved over the old one), in
    milliseconds whatever the model's size. A GGUF's block matrices (GGUFWeights) give their sample from the
    blocks it sits in, the same values as dequantizing them whole, which took most of a 1.5B file's load."""
    digest = hashlib.sha1(repr(config).encode())
    sampled = getattr(weights, "sampled", None)
    for name in sorted(weights):
        shape = weights.shape_of(name) if sampled else tuple(weights[name].shape)
        step = max(1, math.prod(shape) // sample)
        values = sampled(name, step) if sampled else weights[name].reshape(-1)[::step]
        digest.update(f"{name}{shape}".encode())
        digest.update(values.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()[:16]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a given shape, for tiny test models."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    d, hd = config.d_model, config.head_dim
    weights = {"embed": randn(config.vocab_size, d, scale=1.0), "norm": 1 + randn(d, scale=0.1)}
    if not config.tie_embeddings:
        weights["lm_head"] = randn(config.vocab_size, d)
    if config.feature_fed:
        weights |= {"embed_norm": 1 + randn(d, scale=0.1), "feature_norm": 1 + randn(d, scale=0.1),
                    "fc": randn(d, 2 * d)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        weights |= {
            p + "attn_norm": 1 + randn(d, scale=0.1),
            p + "wq": randn(config.n_heads * hd, d),
            p + "wk": randn(config.n_kv_heads * hd, d),
            p + "wv": randn(config.n_kv_heads * hd, d),
            p + "wo": randn(d, config.n_heads * hd),
            p + "ffn_norm": 1 + randn(d, scale=0.1),
            p + "w_gate": randn(config.ffn_dim, d),
            p + "w_up": randn(config.ffn_dim, d),
            p + "w_down": randn(d, config.ffn_dim),
        }
        if config.qkv_bias:
            weights |= {p + "bq": randn(config.n_heads * hd), p + "bk": randn(config.n_kv_heads * hd),
                        p + "bv": randn(config.n_kv_heads * hd)}
        if config.qk_norm:
            weights |= {p + "q_norm": 1 + randn(hd, scale=0.1), p + "k_norm": 1 + randn(hd, scale=0.1)}
    return weights
