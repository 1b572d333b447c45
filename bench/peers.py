"""transformers baselines for `specpool bench`: the same GGUF target (and our distilled draft) through
transformers' own `generate`, timed the same way as our engine.

What transformers 5.x supports here (read from transformers/generation/utils.py and
candidate_generator.py, 5.24):

* Plain `generate` (AR, greedy or sampling) takes any batch size; a batch is left-padded and
  position ids come from the attention mask's cumulative sum, so padding does not shift positions.
* Prompt lookup (`prompt_lookup_num_tokens`) and assisted decoding (`assistant_model`) both run
  `_assisted_decoding`, which raises "assisted generate is only supported for batch_size = 1"
  for a batch of 2 or more. The runners below therefore decode prompts one at a time.
* Assisted decoding with the same vocabulary (target and assistant `config.vocab_size` equal) uses
  `AssistedCandidateGenerator`: the assistant runs its own `generate` for up to
  `num_assistant_tokens` tokens per round, with the target's logits processors. A different
  `vocab_size` switches to "universal assisted decoding", which needs `tokenizer` and
  `assistant_tokenizer` and re-tokenizes text between the two models (and, when sampling, prunes
  the assistant's head to the overlapping vocabulary). Our draft shares the target's tokenizer, so
  the HF draft keeps the full 49152-id vocabulary and gives -inf to ids outside its reduced head.
* The draft length and stopping rule are read from the *assistant's* `generation_config`, not
  from the arguments of the target's `generate` call: `num_assistant_tokens` (default 20),
  `num_assistant_tokens_schedule` (default "constant"; "heuristic" grows it by 2 after a fully
  accepted round, shrinks it by 1 otherwise, and writes it back to the assistant's config so it
  persists across calls) and `assistant_confidence_threshold` (default 0.4: the assistant stops
  drafting early once its top probability falls below it; 0 or None disables this). When
  scikit-learn is installed the threshold is re-fitted online from an ROC curve; it is not
  installed here, so the threshold stays fixed. `hf_assisted` sets these fields on every call.
* At temperature 0 both methods are lossless: they keep the longest prefix of candidates matching
  the target's argmax, so they emit the target's greedy tokens (up to fp rounding of near-ties
  between the 1-token and the (K+1)-token forwards). When sampling, assisted decoding uses the
  speculative-sampling accept/reject rule with the assistant's logits; prompt lookup has no
  candidate distribution and keeps candidates while they equal the target's own samples.
* Stop handling: both assisted paths cut accepted tokens at the first EOS, like plain `generate`.

Sampling always passes top_k=0 and top_p=1.0: transformers' default top_k is 50, ours is off.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specpool.engine.runtime.config import ModelConfig


@dataclass
class PeerRun:
    """One runner call: new tokens per prompt (prompt order), each cut after its first EOS
    (kept), and the wall time of the `generate` calls alone."""

    token_ids: list[list[int]]
    seconds: float
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


# -- models -----------------------------------------------------------------------------------


def load_hf_target(path: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' LlamaForCausalLM reading the GGUF itself (dequantized to `dtype`), in eval mode. It stops
    where the engine does, at the model's own end token (SmolLM2's id 2 is a Qwen model's `#`)."""
    import transformers

    from specpool.engine.runtime.gguf_loader import load_gguf

    path = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = load_gguf(
        path, only={"norm"}).config.eos_id
    return model.eval()


def gguf_to_hf_rope_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows from llama.cpp's layout (RoPE on adjacent pairs: dims 2i, 2i+1 of a head)
    to HF's (RoPE on halves: dims i, i + head_dim/2): the inverse of llama.cpp's converter permute.
    w: [n_heads * head_dim, d_in]."""
    rows, d_in = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, d_in).transpose(1, 2).reshape(rows, d_in)


class ReducedVocabHead(nn.Module):
    """LM head scoring only `output_ids` (row i of `weight` is full-vocab token output_ids[i]),
    returning full-vocabulary logits with -inf elsewhere, as engine.model.Llama does. So the
    assistant never proposes an id outside its vocabulary, transformers still sees the target's
    vocab_size (same-tokenizer assisted decoding), and the draft's head costs what ours costs."""

    def __init__(self, weight: torch.Tensor, output_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [Vd, d]
        self.register_buffer("output_ids", output_ids.long())
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.output_ids, logits)


def load_hf_draft(draft_dir: str | Path, target_path: str | Path, dtype: torch.dtype = torch.float32):
    """Our distilled draft checkpoint (training/distill.py `export`) as a transformers
    LlamaForCausalLM, usable as `generate(..., assistant_model=draft)` with the HF target.

    Input embeddings are the target's (the checkpoint omits them). q/k rows are converted from
    the GGUF RoPE layout our runtime uses to HF's. A reduced-vocabulary head becomes a
    `ReducedVocabHead` (full-vocab logits, -inf outside `output_ids`)."""
    import transformers
    from safetensors.torch import load_file

    from specpool.engine.runtime.gguf_loader import load_gguf

    draft_dir = Path(draft_dir)
    cfg = ModelConfig(**json.loads((draft_dir / "config.json").read_text())["config"])
    weights = load_file(str(draft_dir / "model.safetensors"))
    embed = load_gguf(target_path, only={"embed"}).weights["embed"]

    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_context,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        tie_word_embeddings=False,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.eos_id,
    )
    model = transformers.LlamaForCausalLM(hf_config)

    state = {"model.embed_tokens.weight": embed, "model.norm.weight": weights["norm"]}
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        state |= {
            dst + "input_layernorm.weight": weights[src + "attn_norm"],
            dst + "self_attn.q_proj.weight": gguf_to_hf_rope_layout(weights[src + "wq"], cfg.n_heads),
            dst + "self_attn.k_proj.weight": gguf_to_hf_rope_layout(weights[src + "wk"], cfg.n_kv_heads),
            dst + "self_attn.v_proj.weight": weights[src + "wv"],
            dst + "self_attn.o_proj.weight": weights[src + "wo"],
            dst + "post_attention_layernorm.weight": weights[src + "ffn_norm"],
            dst + "mlp.gate_proj.weight": weights[src + "w_gate"],
            dst + "mlp.up_proj.weight": weights[src + "w_up"],
            dst + "mlp.down_proj.weight": weights[src + "w_down"],
        }
    lm_head = weights.get("lm_head", embed)
    if "output_ids" in weights:
        model.lm_head = ReducedVocabHead(lm_head.float(), weights["output_ids"], cfg.vocab_size)
    else:
        state["lm_head.weight"] = lm_head
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("lm_head.")]  # the reduced head came loaded
    if missing or unexpected:
        raise ValueError(f"draft conversion: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


# -- timed runners ----------------------------------------------------------------------------


def _sampling_kwargs(temperature: float) -> dict:
    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _run(model, batches: list[list[list[int]]], max_new_tokens: int, temperature: float, seed, **extra) -> PeerRun:
    if seed is not None:
        torch.manual_seed(seed)  # transformers samples from torch's global generator
    outputs: list[list[int]] = []
    seconds = 0.0
    eos = model.generation_config.eos_token_id  # also the padding (load_hf_target)
    for batch in batches:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), eos, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, p in enumerate(batch):  # left padding: every row's last prompt token is at the end
            ids[b, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[b, width - len(p) :] = 1
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos,
                **_sampling_kwargs(temperature),
                **extra,
            )
        seconds += time.perf_counter() - start
        outputs += [_until_eos(row, eos) for row in out[:, width:].tolist()]
    return PeerRun(outputs, seconds, sum(len(t) for t in outputs))


def hf_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
) -> PeerRun:
    """Plain AR `generate`, `batch_size` prompts per call (left-padded with EOS, with an attention
    mask). Greedy at temperature 0, else pure temperature sampling. Stops at EOS."""
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    return _run(model, batches, max_new_tokens, temperature, seed)


def hf_prompt_lookup(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_tokens: int = 10,  # drafted per step
    max_ngram: int = 2,  # the longest n-gram looked up
    temperature: float = 0.0,
    seed: int | None = None,
) -> PeerRun:
    """Prompt-lookup decoding (`prompt_lookup_num_tokens=num_tokens`, matching n-grams of up to
    `max_ngram` tokens of prompt + output). transformers refuses batch > 1 for it, so prompts run one
    at a time; `seconds` sums the calls."""
    batches = [[p] for p in prompts]
    return _run(
        model, batches, max_new_tokens, temperature, seed,
        prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram,
    )


def hf_assisted(
    model,
    draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_assistant_tokens: int = 20,
    schedule: str = "constant",
    confidence_threshold: float | None = 0.4,
    temperature: float = 0.0,
    seed: int | None = None,
) -> PeerRun:
    """Assisted decoding with `draft` (from `load_hf_draft`) as `assistant_model`. transformers
    refuses batch > 1 for it, so prompts run one at a time. The draft-length settings (defaults:
    transformers' own) are written to `draft.generation_config`, where transformers reads them;
    pass confidence_threshold=0 with schedule="constant" for a fixed K drafts per round."""
    gc = draft.generation_config
    gc.num_assistant_tokens = num_assistant_tokens
    gc.num_assistant_tokens_schedule = schedule
    gc.assistant_confidence_threshold = confidence_threshold
    batches = [[p] for p in prompts]
    return _run(model, batches, max_new_tokens, temperature, seed, assistant_model=draft)
