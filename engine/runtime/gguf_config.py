"""A GGUF's header -> ModelConfig and the tensors it implies, for the families the engine runs.

Key and tensor names are those llama.cpp's convert_hf_to_gguf.py writes. `llama` covers Llama 2/3/3.x and
Mistral (the converter writes MistralForCausalLM as llama); `qwen2` adds q/k/v biases, `qwen3` per-head q/k
norms and a head width of its own (attention.key_length). Llama 3.1's RoPE scaling travels as a tensor,
`rope_freqs.weight` (each pair's frequency divisor), not as keys. The converter permutes Llama's q and k rows
to adjacent-pair RoPE, the engine's layout; Qwen's it leaves rotating halves (llama.cpp runs them in NeoX
mode), so the loader permutes those (`NEOX`). The converter writes no sliding window for Mistral (llama.cpp
runs it without one); a file that sets `llama.attention.sliding_window` gets it. Anything else a header
asks for (another architecture, partial rotary, a RoPE scaling type) is refused, naming the file and the key.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specpool.engine.runtime.config import FAMILIES, ModelConfig, file_tensors
from specpool.engine.runtime.gguf_file import GGUFFile, GGUFTensor
from specpool.engine.runtime.hf_config import ModelFileError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
NEOX = ("qwen2", "qwen3")  # q/k rows rotate halves in the file: permuted to adjacent pairs at load
ROPE_FREQS = "rope_freqs.weight"

# Per-layer tensors: GGUF name after "blk.{i}." -> the engine's after "layers.{i}.".
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
MODEL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def _fields(path: Path, gguf: GGUFFile):
    def get(key: str, kind: type | tuple[type, ...] = int, default=...):
        """The header's value of `key`, of this type; `default` where it is missing."""
        if key not in gguf.fields:
            if default is ...:
                raise ModelFileError(path, key, "missing")
            return default
        value = gguf.fields[key]
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ModelFileError(path, key, f"{value!r} is not of type {getattr(kind, '__name__', kind)}")
        if kind in (int, float) and value <= 0 and default is ...:
            raise ModelFileError(path, key, f"{value} is not positive")
        return value

    return get


def read_gguf_config(path: Path, gguf: GGUFFile) -> tuple[ModelConfig, str]:
    """(the model's shape, its architecture) from a GGUF's header and tensor list."""
    get, tensors = _fields(path, gguf), gguf.tensors
    arch = get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ModelFileError(path, "general.architecture", f"{arch!r} is not supported (supported: "
                                                           f"{', '.join(ARCHITECTURES)})")
    d_model, n_heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    n_kv_heads = get(f"{arch}.attention.head_count_kv", int, n_heads)
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ModelFileError(path, f"{arch}.attention.head_count_kv", f"{n_kv_heads} does not divide {n_heads} heads")
    head_dim = get(f"{arch}.attention.key_length", int, d_model // n_heads)
    if get(f"{arch}.attention.value_length", int, head_dim) != head_dim:
        raise ModelFileError(path, f"{arch}.attention.value_length", "differs from key_length: not supported")
    if head_dim % 2:
        raise ModelFileError(path, f"{arch}.attention.key_length", f"{head_dim} is odd: RoPE rotates pairs")
    if get(f"{arch}.rope.dimension_count", int, head_dim) != head_dim:
        raise ModelFileError(path, f"{arch}.rope.dimension_count", "partial rotary embeddings are not supported")
    scaling = get(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none" and not (scaling == "linear" and get(f"{arch}.rope.scaling.factor", float, 1.0) == 1.0):
        raise ModelFileError(path, f"{arch}.rope.scaling.type", f"{scaling!r} is not supported (Llama 3.1's scaling "
                                                                f"is read from {ROPE_FREQS})")
    window = get(f"{arch}.attention.sliding_window", int, 0)
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelFileError(path, "token_embd.weight", "missing, or not a matrix")
    eos = get("tokenizer.ggml.eos_token_id", int, 2)
    # Llama 3's <|eot_id|> (and <|eom_id|>) end a turn besides eos.
    extra_eos = [get(f"tokenizer.ggml.{k}_token_id", int, eos) for k in ("eot", "eom")]
    return ModelConfig(
        n_layers=get(f"{arch}.block_count"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=get(f"{arch}.feed_forward_length"),
        vocab_size=embed.shape[0],
        rope_base=get(f"{arch}.rope.freq_base", float, 10000.0),
        norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-5),
        tie_embeddings="output.weight" not in tensors,
        max_context=get(f"{arch}.context_length", int, 4096),
        # Qwen has no BOS: nothing adds it unasked, as in hf_config.
        bos_id=get("tokenizer.ggml.bos_token_id", int, 1 if arch == "llama" else eos),
        eos_id=eos,
        extra_eos_ids=tuple(dict.fromkeys(i for i in extra_eos if i != eos)),
        head_dim=head_dim,
        rope_freq_factors=_rope_freq_factors(path, tensors.get(ROPE_FREQS), head_dim),
        sliding_window=window or None,
        **asdict(FAMILIES[arch]),
    ), arch


def _rope_freq_factors(path: Path, tensor: GGUFTensor | None, head_dim: int) -> tuple[float, ...] | None:
    if tensor is None:
        return None
    factors = tensor.data.reshape(-1).tolist() if tensor.type.name == "F32" else None
    if factors is None or len(factors) != head_dim // 2 or min(factors) <= 0:
        raise ModelFileError(path, ROPE_FREQS, f"expected {head_dim // 2} positive F32 factors (one per RoPE pair), "
                                               f"got {tensor.type.name} {list(tensor.shape)}")
    return tuple(factors)


def expected_gguf_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (our name, shape [out, in]) of every tensor a model of this config has
    (rope_freqs, read into the config, aside)."""
    return file_tensors(config, {"embed": "token_embd.weight", "norm": "output_norm.weight",
                                 "lm_head": "output.weight"}, LAYER_NAMES, "blk.{}.")


def neox_heads(ours: str, config: ModelConfig) -> int | None:
    """How many heads a tensor's rows hold, for those a NeoX file keeps rotating halves (q, k, their biases
    and norms); None for the rest."""
    kind = ours.rsplit(".", 1)[-1]
    return {"wq": config.n_heads, "bq": config.n_heads, "wk": config.n_kv_heads, "bk": config.n_kv_heads,
            "q_norm": 1, "k_norm": 1}.get(kind) if ours.startswith("layers.") else None
