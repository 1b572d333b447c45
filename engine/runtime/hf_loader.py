"""Read a Hugging Face model directory: config.json, the safetensors shards, tokenizer.json and the chat template.

Weights get the engine's names (engine/runtime/model.py `random_weights`) and its RoPE layout: the q and k
rows (and their biases and norms) are permuted from rotate-half to adjacent pairs (engine/runtime/rope.py).
Every tensor the config implies must be there with its shape, and no other: a bad file fails here,
naming the file and the tensor, never later as a crash or a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError
from safetensors import safe_open

from specpool.engine.runtime.config import ModelConfig, file_tensors
from specpool.engine.runtime.hf_config import ModelFileError, read_config, read_json
from specpool.engine.runtime.rope import to_adjacent_pairs
from specpool.engine.runtime.tokenizer import Tokenizer

# Per-layer tensors: HF name after "model.layers.{i}." -> the engine's after "layers.{i}.".
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class HFModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # our names -> tensors in the file's float dtype, the engine's RoPE layout


def expected_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (our name, shape) of every tensor a model of this config has."""
    return file_tensors(config, {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                                 "lm_head": "lm_head.weight"}, _LAYER_NAMES, "model.layers.{}.")


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the engine recomputes or does not need."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings)


def _shards(directory: Path) -> tuple[Path, dict[str, Path]]:
    """(the file that lists the tensors, tensor name -> its shard); one file lists its own."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(index, "weight_map", "missing or not an object")
        for name, shard in weight_map.items():  # a model file is data: its index names files beside it, no others
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise ModelFileError(index, f"weight_map.{name}", f"{shard!r} is not a file name in the directory")
        return index, {name: directory / shard for name, shard in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ModelFileError(single, "model.safetensors", "no weights: neither it nor model.safetensors.index.json")
    with _open(single) as f:
        return single, dict.fromkeys(f.keys(), single)


def load_hf(directory: str | Path, only: set[str] | None = None) -> HFModel:
    """Read a HF model directory; `only` limits which weights are read (our names: a drafter needs "embed")."""
    directory = Path(directory)
    config = read_config(directory)
    listing, located = _shards(directory)
    expected = expected_tensors(config)
    unexpected = sorted(n for n in located if n not in expected and not _ignored(n, config))
    if unexpected:
        raise ModelFileError(located[unexpected[0]], unexpected[0],
                             f"a tensor this {config.n_layers}-layer config has no place for "
                             f"({len(unexpected)} such; is config.json this checkpoint's?)")
    missing = [n for n in expected if n not in located]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(listing, missing[0], f"missing{more}")
    wanted = {n: e for n, e in expected.items() if only is None or e[0] in only}
    weights = {}
    for shard in sorted({located[n] for n in wanted}):
        with _open(shard) as f:
            present = set(f.keys())
            for name in (n for n in wanted if located[n] == shard):
                ours, shape = wanted[name]
                if name not in present:
                    raise ModelFileError(shard, name, f"missing (the index {listing.name} places it here)")
                try:
                    t = f.get_tensor(name)
                except Exception as e:  # safetensors' own errors, or the OS's
                    raise ModelFileError(shard, name, f"unreadable ({e})") from e
                if tuple(t.shape) != shape:
                    raise ModelFileError(shard, name, f"shape {tuple(t.shape)}, expected {shape} from config.json")
                if t.dtype not in _FLOATS:
                    raise ModelFileError(shard, name, f"dtype {t.dtype} is not float32, float16 or bfloat16")
                weights[ours] = t
    return HFModel(config, _to_engine_layout(weights, config))


def _open(shard: Path):
    """safe_open, its failures named: safetensors checks at open that the header's tensors fill the file
    exactly, so a truncated or padded shard fails here."""
    if not shard.is_file():
        raise ModelFileError(shard, shard.name, "missing")
    try:
        return safe_open(shard, framework="pt")
    except Exception as e:  # safetensors' own error types
        raise ModelFileError(shard, "safetensors header", f"unreadable ({e})") from e


def _to_engine_layout(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """q and k rows, their biases and norms from rotate-half to adjacent pairs (engine/runtime/rope.py)."""
    heads = {"wq": config.n_heads, "bq": config.n_heads, "wk": config.n_kv_heads, "bk": config.n_kv_heads,
             "q_norm": 1, "k_norm": 1}
    for name, t in weights.items():
        kind = name.rsplit(".", 1)[-1]
        if name.startswith("layers.") and kind in heads:
            weights[name] = to_adjacent_pairs(t, heads[kind])
    return weights


def load_hf_tokenizer(directory: str | Path, config: ModelConfig) -> Tokenizer | None:
    """tokenizer.json with tokenizer_config.json's chat template (or chat_template.jinja); None without
    tokenizer.json. A template that cannot render one user message is refused here, not at a request."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    settings_path = directory / "tokenizer_config.json"
    settings = read_json(settings_path) if settings_path.is_file() else {}
    template, template_path = _chat_template(directory, settings, settings_path)
    try:
        tokenizer = Tokenizer.from_hf(path.read_text(), template, config.bos_id, config.eos_id,
                                      _special_tokens(settings))
    except TemplateError as e:
        raise ModelFileError(template_path, "chat_template", f"does not compile ({e})") from e
    except Exception as e:  # tokenizers' own errors
        raise ModelFileError(path, "tokenizer.json", f"unreadable ({e})") from e
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFileError(path, "vocabulary", f"{tokenizer.vocab_size} tokens, more than the model's "
                                                 f"vocab_size {config.vocab_size}")
    if template is not None:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except Exception as e:  # jinja's errors, or the template's own: anything a request would meet
            raise ModelFileError(template_path, "chat_template", f"fails to render a user message "
                                                                 f"({type(e).__name__}: {e})") from e
    return tokenizer


def _special_tokens(settings: dict) -> dict[str, str | None]:
    """tokenizer_config.json's bos_token, eos_token, ... (a string, or an AddedToken's fields), as transformers
    hands them to a chat template: Qwen's bos_token is null, whatever config.json's bos_token_id says."""
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if key in settings:
            value = settings[key]
            tokens[key] = value.get("content") if isinstance(value, dict) else value
    return tokens


def _chat_template(directory: Path, settings: dict, settings_path: Path) -> tuple[str | None, Path]:
    """(the default chat template, the file it came from)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():  # where transformers 4.50+ saves it
        return jinja_file.read_text(), jinja_file
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise ModelFileError(settings_path, "chat_template", "not a string")
    return template, settings_path


def load_model_file(path: str | Path, only: set[str] | None = None):
    """A GGUF file or a Hugging Face model directory: an object with its `config` and `weights` (our names)."""
    from specpool.engine.runtime.gguf_loader import load_gguf

    return load_hf(path, only) if Path(path).is_dir() else load_gguf(path, only)
