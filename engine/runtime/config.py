"""Model shape, read from a GGUF header or written by hand for tiny test models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_context: int = 8192
    bos_id: int = 1
    eos_id: int = 2
    # A draft head (EAGLE style): each position's input fuses the token's embedding with a feature
    # (the target's last hidden state, or the head's own prediction of it) instead of the embedding alone.
    feature_fed: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def tiny_config(vocab_size: int = 64, n_layers: int = 2, d_model: int = 32) -> ModelConfig:
    """A random-init model shape for unit tests: builds and runs in milliseconds."""
    return ModelConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=2 * d_model,
        vocab_size=vocab_size,
        rope_base=10000.0,
        max_context=512,
    )
