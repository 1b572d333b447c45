"""Tiny transformers models written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes them, and
quantized by llama.cpp itself: the files tests/engine/runtime/test_gguf_families.py loads in the engine and in llama.cpp.

What the converter does, per architecture, and so what this writer does:
- LlamaForCausalLM and MistralForCausalLM -> `llama`: q and k rows permuted from rotate-half to adjacent
  pairs (its `LlamaModel.permute`, k over the KV heads); no output.weight when the embeddings are tied;
  Llama 3.1's RoPE scaling as `rope_freqs.weight`, each pair's frequency divisor in F32; no sliding window
  key for Mistral (this writer adds `llama.attention.sliding_window` only when asked).
- Qwen2ForCausalLM -> `qwen2`, Qwen3ForCausalLM -> `qwen3`: q and k left rotating halves (llama.cpp runs
  them in NeoX mode); Qwen2's q/k/v biases as attn_{q,k,v}.bias, Qwen3's norms as attn_{q,k}_norm.weight.
- Matrices F16, vectors (norms, biases, rope_freqs) F32: the converter's --outtype f16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter, LlamaFileType

from specpool.engine.runtime.rope import to_adjacent_pairs

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def round_to_f16(model) -> None:
    """Round the model's matrices through fp16, so an F16 file holds exactly its weights."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())


def byte_vocabulary(size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of `size` tokens (GPT-2's byte characters, then merged pairs) and its
    merges: llama.cpp refuses a file without one, and the tests feed token ids."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes_to_unicode
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    pairs = [(a, b) for a in "abcdefghij" for b in "klmnopqrst"][: max(1, size // 8)]
    tokens = chars[: size - len(pairs)] + [a + b for a, b in pairs]
    return tokens, [f"{a} {b}" for a, b in pairs]


def sentencepiece_vocabulary(lines: list[str], pieces: int = 300,
                             control: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary as Llama 2's and Mistral's GGUFs spell it: tokens, scores, token types.
    <unk> (type 2), <s> and </s> (control, 3), the 256 byte tokens <0x00>..<0xFF> (6) a character outside the
    vocabulary falls back to, then up to `pieces` pieces BPE learns from `lines` ("▁" for a space), each scored
    minus its rank as SentencePiece scores them, then `control`'s tokens (Mistral v0.3's [INST], ...)."""
    from tokenizers import SentencePieceBPETokenizer

    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(lines, vocab_size=pieces, min_frequency=2, show_progress=False, special_tokens=[])
    learned = sorted(learner.get_vocab(), key=learner.get_vocab().get)
    # Runs of spaces, as Llama 2 has them for code (SentencePiece's whitespace split learns none of them).
    learned += ["▁▁", "▁▁▁", "▁▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned, *control]
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))] + [0.0] * len(control)
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned) + [3] * len(control)
    return tokens, scores, types


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Each RoPE pair's frequency divisor for Llama 3.1's scaling, computed as the converter computes it
    (in fp32 frequencies)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(model, path: Path, window: bool = False, arch: str | None = None,
               header: Callable[[GGUFWriter], None] | None = None,
               edit: Callable[[str, np.ndarray], np.ndarray | tuple | None] | None = None,
               tokens: list[str] | None = None, merges: list[str] | None = None, pre: str = "default",
               scores: list[float] | None = None, token_types: list[int] | None = None, add_bos: bool = False) -> Path:
    """`model` (a transformers causal LM of a supported family) as an F16 GGUF at `path`. `window`: write
    the config's sliding window as llama.attention.sliding_window (the converter writes none).
    For bad files: `arch` names another architecture, `header` adds keys, `edit(name, array)` returns the
    array to write instead, (raw bytes, their GGML type), or None to leave the tensor out. `tokens`: the
    vocabulary to write instead of `byte_vocabulary`'s, `merges` its merges, `pre` its pre-tokenizer
    (tokenizer.ggml.pre: llama.cpp's name for the split regex, as the converter writes it). `scores` (with
    `token_types`, from `sentencepiece_vocabulary`): `tokens` are a SentencePiece vocabulary, written as the
    converter writes Llama 2's (tokenizer.ggml.model llama, no merges, BOS added, a space prefixed); else
    byte-level BPE, with add_bos_token `add_bos` (Llama 3's converter sets it, SmolLM2's clears it)."""
    cfg = model.config
    arch = arch or ARCH[cfg.architectures[0] if cfg.architectures else type(model).__name__]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = _rope(cfg)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
        if window and getattr(cfg, "sliding_window", None):
            writer.add_sliding_window(cfg.sliding_window)
    if scores is not None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
    else:
        own, own_merges = byte_vocabulary(len(tokens) if tokens else cfg.vocab_size)
        tokens, merges = tokens or own, merges or own_merges
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(tokens))
        writer.add_token_merges(merges)
        writer.add_add_bos_token(add_bos)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0])
    if header is not None:
        header(writer)

    def put(name: str, array: np.ndarray) -> None:
        array = edit(name, array) if edit is not None else array
        if isinstance(array, tuple):
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        elif array is not None:
            writer.add_tensor(name, array)

    if rope.get("rope_type") == "llama3":
        put("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    for name, tensor in model.state_dict().items():
        gguf_name = _gguf_name(name, cfg)
        if gguf_name is None:
            continue
        t = tensor.detach().float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = to_adjacent_pairs(t, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            t = to_adjacent_pairs(t, cfg.num_key_value_heads)
        put(gguf_name, t.numpy().astype(np.float16 if t.dim() == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope(cfg) -> dict:
    """transformers 5's rope_parameters, or 4's rope_theta and rope_scaling, as one dict."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return params


def _gguf_name(name: str, cfg) -> str | None:
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "output.weight"
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{i}.{LAYER[rest]}"


def quantize(source: Path, target: Path, ftype: str) -> Path:
    """`source` quantized by llama.cpp's own llama_model_quantize (ftype: a LLAMA_FTYPE_MOSTLY_* suffix, e.g.
    "Q8_0", "Q4_K_M"). Rows too narrow for a K-quant fall back to the type llama.cpp picks for them."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return target
