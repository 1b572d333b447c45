"""Rotary position embeddings: the angles the engine rotates by, and the one layout it rotates in.

The engine rotates ADJACENT pairs of a head's dims, (x[2i], x[2i+1]), llama.cpp's GGUF layout. Hugging
Face checkpoints rotate halves, (x[i], x[i + D/2]) ("rotate_half", the NeoX layout): their q and k rows are
permuted once at load (`to_adjacent_pairs`), as llama.cpp's convert_hf_to_gguf.py does, so every model
runs one RoPE. Attention is unchanged by it: q and k of a head are permuted alike, and q.k sums over all dims.
"""

from __future__ import annotations

import math

import torch

from specpool.engine.runtime.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float64: the rotation speed of each pair, with the config's scaling applied."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling, as Meta's reference and transformers (`_compute_llama3_parameters`) compute it."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_context / s.low_freq_factor  # longer waves: slowed by `factor`
    high_freq_wavelen = s.original_context / s.high_freq_factor  # shorter waves: kept
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_angles(config: ModelConfig) -> torch.Tensor:
    """[max_context, head_dim/2] rotation angles, in float64 so long positions stay exact."""
    return torch.outer(torch.arange(config.max_context, dtype=torch.float64), inverse_frequencies(config))


def to_adjacent_pairs(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k projection rows (or their bias, or a per-head norm's weight with n_heads=1) from the
    rotate-half layout to the engine's adjacent pairs: row i + j*D/2 of a head becomes row 2i + j.
    t: [n_heads * D, ...] -> the same shape."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# RoPE's angles at some positions: their complex cis, or their (cos, sin) pair, each [..., D/2] broadcasting
# against a [..., D] tensor's pairs.
Angles = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, angles: Angles) -> torch.Tensor:
    """x [..., D] with each adjacent pair (x[2i], x[2i+1]) rotated by its angle. A cis rotates in fp32 as one
    complex multiply where the pairwise form takes seven ops; (cos, sin) takes the pairwise form: bf16's (torch
    has no bf16 complex numbers) and training's."""
    D = x.shape[-1]
    if isinstance(angles, torch.Tensor):
        x = torch.view_as_complex(x.float().unflatten(-1, (D // 2, 2)))
        return torch.view_as_real(x * angles).flatten(-2)
    cos, sin = angles
    x = x.unflatten(-1, (D // 2, 2))
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
