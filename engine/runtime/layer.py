"""One transformer block, the one every caller runs: the runtime's steps (engine/runtime/model.py) and
training's draft and head (training/distill.py, training/head.py).

The callers differ in their matrices and their attention, so both come in: a layer's weights are a dict
whose matrices are callables (the runtime's prepacked, int4 or block kernels; training's plain matmuls on
nn.Parameters), and `attend` is the caller's attention (the runtime's over its KV cache; training's over
the whole sequence). The runtime's logits depend on this op order bit for bit: decode and verify rows
must stay the same bits (engine/runtime/row_check.py), so change it only with that check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from specpool.engine.runtime.config import ModelConfig
from specpool.engine.runtime.rope import Angles, rotate

# q [B, T, H, D], k and v [B, T, Hkv, D] (k rotated) -> [B, T, H, D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer(x: torch.Tensor, weights: Mapping[str, Any], config: ModelConfig, angles: Angles,
          attend: Attention) -> torch.Tensor:
    """x [B, T, d] -> [B, T, d]: norm, q/k/v projections (with the family's biases and q/k norms), RoPE,
    attention, output projection and residual, then the SiLU-gated MLP and its residual.

    `weights`: what `block_weights` builds; a matrix is called as matrix(x) or matrix(x, norm, eps), the
    latter the product of F.rms_norm(x, norm, eps). `angles`: RoPE's at each fed position (`rotate`)."""
    B, T = x.shape[:2]
    H, Hkv, D = config.n_heads, config.n_kv_heads, config.head_dim
    qkv = weights["wqkv"](x, weights["attn_norm"], config.norm_eps)
    if "bqkv" in weights:
        qkv = qkv + weights["bqkv"]
    qkv = qkv.view(B, T, H + 2 * Hkv, D)
    qk = qkv[:, :, : H + Hkv]
    if "qk_norm" in weights:
        qk = F.rms_norm(qk, (D,), eps=config.norm_eps) * weights["qk_norm"]
    qk = rotate(qk, angles)  # q and k heads together
    attn = attend(qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv :])
    # A quantized matrix returns bf16 (its kernel's output): the residual adds promote it to fp32.
    x = x + weights["wo"](attn.reshape(B, T, H * D))
    gate, up = weights["w_gate_up"](x, weights["ffn_norm"], config.norm_eps).chunk(2, dim=-1)
    return x + weights["w_down"](F.silu(gate) * up)


def block_weights(tensor: Callable[[str], torch.Tensor], matrix: Callable[..., Any], config: ModelConfig) -> dict:
    """One layer's weights as `layer` reads them. tensor(name): the layer's tensor of that name (after
    "layers.{i}.", as config.layer_shapes names it); matrix(*names): one product over those matrices
    stacked along their outputs."""
    H, Hkv = config.n_heads, config.n_kv_heads
    weights = {
        "attn_norm": tensor("attn_norm"),
        # q, k and v in one matmul; gate and up in another: fewer kernel launches per layer.
        "wqkv": matrix("wq", "wk", "wv"),  # [(H+2Hkv)*D, d]
        "wo": matrix("wo"),
        "ffn_norm": tensor("ffn_norm"),
        "w_gate_up": matrix("w_gate", "w_up"),  # [2F, d]
        "w_down": matrix("w_down"),
    }
    if config.qkv_bias:
        weights["bqkv"] = torch.cat([tensor("bq"), tensor("bk"), tensor("bv")])  # [(H+2Hkv)*D]
    if config.qk_norm:  # one weight row per q and k head: one norm call for both
        weights["qk_norm"] = torch.cat([tensor("q_norm").expand(H, -1), tensor("k_norm").expand(Hkv, -1)])
    return weights


class Products:
    """Training's matrix: x @ w.T for each of `matrices`, side by side along the output. Each is its own
    matmul, as the trainable models computed them before they shared this block, so their numbers did
    not move; plain ops on the parameters, so autograd runs through them."""

    def __init__(self, *matrices: torch.Tensor):
        self.matrices = matrices

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        if norm is not None:
            x = F.rms_norm(x, (x.shape[-1],), norm, eps)
        products = [x @ w.T for w in self.matrices]
        return products[0] if len(products) == 1 else torch.cat(products, -1)


def trainable_weights(params: Mapping[str, torch.Tensor], config: ModelConfig) -> dict:
    """`layer`'s weights from one layer's parameters, by config.layer_shapes' names."""
    return block_weights(params.__getitem__, lambda *names: Products(*(params[n] for n in names)), config)
