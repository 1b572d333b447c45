"""A Hugging Face config.json -> ModelConfig, for the families the engine runs.

Llama (2, 3, 3.1, 3.2), Mistral, Qwen2/2.5 and Qwen3 are one Llama forward that differs by a few
ModelConfig fields. Anything else a config asks for (another architecture or activation, an o_proj or MLP
bias, a RoPE type other than llama3, sliding windows on some layers only) is refused at load, naming the
file and the key: run silently, it would give wrong answers.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specpool.engine.runtime.config import FAMILIES, ModelConfig, RopeScaling

# architectures[0] -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelFileError(ValueError):
    """A model file the engine cannot run, named with the field at fault (a config key, a tensor name)."""

    def __init__(self, path: str | Path, field: str, problem: str):
        self.path, self.field = Path(path), field
        super().__init__(f"{path}: {field}: {problem}")


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(path, path.name, f"cannot read it as JSON ({e})") from e
    if not isinstance(value, dict):
        raise ModelFileError(path, path.name, "not a JSON object")
    return value


def read_config(directory: Path) -> ModelConfig:
    """The directory's config.json (and generation_config.json's end tokens) as a ModelConfig."""
    path = directory / "config.json"
    if not path.is_file():
        ggufs = sorted(p.name for p in directory.glob("*.gguf"))
        hint = f" (or pass one of its GGUF files: {', '.join(ggufs)})" if ggufs else ""
        raise ModelFileError(path, "config.json", f"missing: a Hugging Face model directory needs one{hint}")
    raw = read_json(path)

    def get(key: str, kind: type | tuple[type, ...] = int, default=...):
        """raw[key], of this type (a bool is no int here); `default` where it is missing or null."""
        value = raw.get(key)
        if value is None:
            if default is ...:
                raise ModelFileError(path, key, "missing")
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ModelFileError(path, key, f"{value!r} is not of type {getattr(kind, '__name__', kind)}")
        if kind is int and value <= 0:
            raise ModelFileError(path, key, f"{value} is not positive")
        return value

    archs = raw.get("architectures") or []
    family = ARCHITECTURES.get(archs[0]) if isinstance(archs, list) and archs else None
    if family is None:
        raise ModelFileError(path, "architectures", f"{archs!r} is not supported (supported: "
                                                     f"{', '.join(ARCHITECTURES)})")
    if get("hidden_act", str, "silu") != "silu":
        raise ModelFileError(path, "hidden_act", f"{raw['hidden_act']!r} is not supported (only silu)")
    if get("mlp_bias", bool, False):
        raise ModelFileError(path, "mlp_bias", "MLP biases are not supported")
    # Llama's and Qwen3's attention_bias puts a bias on o_proj too, which the engine has no place for.
    if family in ("llama", "qwen3") and get("attention_bias", bool, False):
        raise ModelFileError(path, "attention_bias", "a bias on o_proj is not supported")

    d_model, n_heads = get("hidden_size"), get("num_attention_heads")
    n_layers = get("num_hidden_layers")
    n_kv_heads = get("num_key_value_heads", int, n_heads)
    if n_heads % n_kv_heads:
        raise ModelFileError(path, "num_key_value_heads", f"{n_kv_heads} does not divide {n_heads} heads")
    head_dim = get("head_dim", int, d_model // n_heads)
    if head_dim % 2:
        raise ModelFileError(path, "head_dim", f"{head_dim} is odd: RoPE rotates pairs")
    max_context = get("max_position_embeddings", int, 4096)
    rope_base, rope_scaling = _rope(raw, path, max_context)
    eos = _token_ids(raw.get("eos_token_id"), path, "eos_token_id")
    generation = directory / "generation_config.json"
    if generation.is_file():  # generation's end tokens (Llama 3.1: <|eot_id|> too) stop a sequence as well
        eos += [i for i in _token_ids(read_json(generation).get("eos_token_id"), generation, "eos_token_id")
                if i not in eos]
    if not eos:
        raise ModelFileError(path, "eos_token_id", "missing (here and in generation_config.json)")
    bos = _token_ids(raw.get("bos_token_id"), path, "bos_token_id")
    return ModelConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        rope_base=rope_base,
        norm_eps=float(get("rms_norm_eps", (int, float), 1e-6)),
        tie_embeddings=get("tie_word_embeddings", bool, False),  # each family's class default
        max_context=max_context,
        bos_id=bos[0] if bos else eos[0],  # (Qwen has no BOS; nothing adds it unasked)
        eos_id=eos[0],
        extra_eos_ids=tuple(eos[1:]),
        head_dim=head_dim,
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window(raw, path, family, n_layers),
        **asdict(FAMILIES[family]),
    )


def _token_ids(value, path: Path, key: str) -> list[int]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelFileError(path, key, f"{value!r} is not a token id or a list of them")
    return ids


def _rope(raw: dict, path: Path, max_context: int) -> tuple[float, RopeScaling | None]:
    """(base, scaling) from transformers 5's `rope_parameters` or 4's `rope_theta` and `rope_scaling`."""
    key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ModelFileError(path, key, f"{params!r} is not an object")
    base = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(base, (int, float)) or base <= 0:
        raise ModelFileError(path, "rope_theta", f"{base!r} is not a positive number")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelFileError(path, f"{key}.partial_rotary_factor", "partial rotary embeddings are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(base), None
    if kind != "llama3":
        raise ModelFileError(path, f"{key}.rope_type", f"{kind!r} is not supported (default or llama3)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_context=int(params.get("original_max_position_embeddings", max_context)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(path, key, f"llama3 scaling needs factor, low_freq_factor and high_freq_factor ({e!r})") \
            from e
    if scaling.factor <= 0 or scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ModelFileError(path, key, "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor")
    return float(base), scaling


def _sliding_window(raw: dict, path: Path, family: str, n_layers: int) -> int | None:
    """Mistral's window covers every layer; Qwen's only the layers `layer_types` (transformers 5) or
    use_sliding_window with max_window_layers (4) mark: all of them or none, or the model is refused."""
    window = raw.get("sliding_window")
    if family == "llama" or window is None:
        return None
    if family != "mistral":
        if "layer_types" in raw:
            windowed = [t == "sliding_attention" for t in raw["layer_types"]]
        else:
            first = raw.get("max_window_layers", n_layers)
            windowed = [bool(raw.get("use_sliding_window")) and i >= first for i in range(n_layers)]
        if not any(windowed):
            return None
        if not all(windowed):
            raise ModelFileError(path, "layer_types" if "layer_types" in raw else "use_sliding_window",
                                 "a sliding window on some layers only is not supported")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelFileError(path, "sliding_window", f"{window!r} is not a positive integer")
    return window
