"""Model shape, read from a GGUF header or a Hugging Face config.json, or written by hand for tiny test models.

One description covers the families the engine runs (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3): they
differ only by the fields after `feature_fed` (RoPE scaling, a sliding window, q/k/v biases, per-head
q/k norms, a head width of their own).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling ("rope_type": "llama3"): wavelengths longer than
    original_context / low_freq_factor are stretched by `factor`, shorter than original_context /
    high_freq_factor kept, and those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int


@dataclass(frozen=True, slots=True)
class Family:
    """What a model family's layers add to Llama's: the one table both loaders read (gguf_config.py by
    general.architecture, hf_config.py by architectures[0])."""

    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # an RMS norm over each q and k head before RoPE (Qwen3)


FAMILIES = {"llama": Family(), "mistral": Family(), "qwen2": Family(qkv_bias=True), "qwen3": Family(qk_norm=True)}


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
    # The width of a q/k/v head; None: d_model / n_heads (Qwen3 sets its own). Resolved at construction,
    # so `dataclasses.replace` of d_model or n_heads must pass head_dim too.
    head_dim: int | None = None
    rope_scaling: RopeScaling | None = None  # a dict (from JSON) is read as RopeScaling
    # Each RoPE pair's frequency divided by its factor: how a GGUF stores Llama 3.1's scaling (llama.cpp's
    # rope_freqs tensor, computed from rope_scaling by its converter). None: no factors.
    rope_freq_factors: tuple[float, ...] | None = None
    # A query sees only the last `sliding_window` positions, itself included (Mistral); None: all of them.
    sliding_window: int | None = None
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2): weights layers.i.bq, bk, bv
    qk_norm: bool = False  # an RMS norm over each q and k head before RoPE (Qwen3): layers.i.q_norm, k_norm
    # Tokens that end a sequence besides eos_id (Llama 3's <|eot_id|>, <|eom_id|>).
    extra_eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "extra_eos_ids", tuple(self.extra_eos_ids))
        if self.rope_freq_factors is not None:
            object.__setattr__(self, "rope_freq_factors", tuple(self.rope_freq_factors))

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a sequence by default."""
        return (self.eos_id, *self.extra_eos_ids)

    @property
    def windowed(self) -> bool:
        """Whether some query can be denied a key by the sliding window (a window of the whole context
        never is)."""
        return self.sliding_window is not None and self.sliding_window < self.max_context


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A layer's tensors in this family, by the engine's name after "layers.{i}.", and their shapes [out, in]:
    Qwen2's q/k/v biases and Qwen3's q/k norms besides Llama's."""
    d, D, H, Hkv, F = config.d_model, config.head_dim, config.n_heads, config.n_kv_heads, config.ffn_dim
    shapes = {"attn_norm": (d,), "wq": (H * D, d), "wk": (Hkv * D, d), "wv": (Hkv * D, d), "wo": (d, H * D),
              "ffn_norm": (d,), "w_gate": (F, d), "w_up": (F, d), "w_down": (d, F)}
    if config.qkv_bias:
        shapes |= {"bq": (H * D,), "bk": (Hkv * D,), "bv": (Hkv * D,)}
    if config.qk_norm:
        shapes |= {"q_norm": (D,), "k_norm": (D,)}
    return shapes


def file_tensors(config: ModelConfig, names: dict[str, str], layer_names: dict[str, str],
                 layer_prefix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A model file's tensor name -> (the engine's name, shape [out, in]) of every tensor a model of this
    config has. `names`: the file's names of embed, norm and lm_head (keyed by the engine's); `layer_names`:
    the file's name after `layer_prefix.format(i)` -> the engine's after "layers.{i}." (GGUF and Hugging Face
    directories differ only in these names)."""
    d, shapes = config.d_model, layer_shapes(config)
    tensors = {names["embed"]: ("embed", (config.vocab_size, d)), names["norm"]: ("norm", (d,))}
    if not config.tie_embeddings:
        tensors[names["lm_head"]] = ("lm_head", (config.vocab_size, d))
    for i in range(config.n_layers):
        for name, ours in layer_names.items():
            if ours in shapes:
                tensors[layer_prefix.format(i) + name] = (f"layers.{i}.{ours}", shapes[ours])
    return tensors


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
