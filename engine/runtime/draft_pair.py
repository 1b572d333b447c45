"""A draft model of its own (a GGUF or a Hugging Face directory: Llama 3.2 1B for 3.1 8B, Qwen2.5 0.5B for
7B) paired with a target: it must speak the target's tokens.

Sessions feed a draft the target's token ids and verify its proposals as the target's. So a pair is taken
when the two vocabularies are the same token strings: in the same order (the usual case; the files may still
pad their embedding tables to different sizes, as Qwen2.5's 0.5B and 7B do), or in another order, a one to
one map, applied once at load: the draft's input rows move to the target's ids and its output rows score
the target's ids (`output_ids`), so the running draft is a model over the target's ids. Any other pair is
refused at start, naming both files and their sizes: its proposals would be other tokens.

A distilled draft or head checkpoint (training/) reads the target's own embeddings and, for a head, its
features: `check_trained_for` refuses one trained for another target, naming both.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specpool.engine.runtime.config import ModelConfig
from specpool.engine.runtime.hf_config import ModelFileError, read_json


class VocabularyMismatch(ValueError):
    """A draft whose tokens are not the target's."""


def token_strings(path: str | Path) -> list[str] | None:
    """The model file's tokens by id (a GGUF's tokenizer.ggml.tokens, a directory's tokenizer.json with its
    added tokens); None where the file has no vocabulary."""
    path = Path(path)
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        from tokenizers import Tokenizer

        try:
            vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
        except Exception as e:  # tokenizers' own errors
            raise ModelFileError(file, "tokenizer.json", f"unreadable ({e})") from e
        tokens = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for text, i in vocab.items():
            tokens[i] = text
        return tokens
    from specpool.engine.runtime.gguf_file import GGUFFile

    tokens = GGUFFile.read(path).fields.get("tokenizer.ggml.tokens")
    return None if tokens is None else list(tokens)


def draft_to_target_ids(draft_path: Path, draft_rows: int, target_path: Path, target_rows: int) -> torch.Tensor | None:
    """The target id of each of the draft's tokens ([draft tokens] long), or None where every draft row is
    the target's token of the same id. Raises VocabularyMismatch naming both files where the vocabularies
    are not one to one."""
    draft, target = token_strings(draft_path), token_strings(target_path)

    def refuse(why: str) -> VocabularyMismatch:
        sizes = (f"draft {draft_path} ({_count(draft)} tokens, {draft_rows} embedding rows) and target {target_path}"
                 f" ({_count(target)} tokens, {target_rows} embedding rows)")
        return VocabularyMismatch(f"{sizes}: {why}; a draft must share the target's tokenizer")

    if draft is None or target is None:  # nothing to compare but sizes (tiny test models are fed ids)
        if draft_rows != target_rows:
            raise refuse("the vocabularies differ in size, and one file has no tokens to map by")
        return None
    if len(draft) > draft_rows:
        raise refuse("the draft lists more tokens than its embedding has rows")
    if draft == target[: len(draft)] and len(draft) == len(target):
        return None if draft_rows <= target_rows else torch.arange(len(draft))
    ids = {text: i for i, text in enumerate(target)}
    foreign = [t for t in draft if t not in ids]
    if foreign or len(set(draft)) != len(draft) or len(draft) != len(target):
        examples = ", ".join(repr(t) for t in foreign[:3])
        raise refuse(f"the vocabularies differ ({len(foreign)} of the draft's tokens are not the target's"
                     f"{': ' + examples if examples else ''})")
    return torch.tensor([ids[t] for t in draft])


def _count(tokens: list[str] | None) -> str:
    return "no" if tokens is None else str(len(tokens))


def map_to_target(config: ModelConfig, weights: dict[str, torch.Tensor], target_ids: torch.Tensor | None,
                  target_rows: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The draft over the target's ids: input embedding rows moved to them (rows of ids the draft lacks stay
    zero: a target never feeds them in practice, padding rows), output rows kept and labelled with the target
    id each scores. Unchanged where `target_ids` is None and the tables are as long as the target's."""
    rows = weights["embed"].shape[0]
    if target_ids is None and rows == target_rows:
        return config, weights
    if target_ids is None:  # the same tokens, the draft's table shorter (padding)
        target_ids = torch.arange(rows)
    n = len(target_ids)
    head = weights["embed" if config.tie_embeddings else "lm_head"][:n]
    embed = weights["embed"].new_zeros(target_rows, weights["embed"].shape[1])
    embed[target_ids] = weights["embed"][:n]
    weights = weights | {"embed": embed, "lm_head": head, "output_ids": target_ids}
    return replace(config, vocab_size=target_rows, tie_embeddings=False, head_dim=config.head_dim), weights


# The draft's head scores the target's lowest ids alone: BPE numbers its tokens in merge order, so these are
# its commonest (96% of the 1.5B's tokens on code, 94% on English). A head of 151,936 rows was over a third of
# the Qwen2.5-Coder 0.5B's step; at 32,768 rows its step fell from 14.8 to 9.6 ms. A token outside is never
# drafted, so the target's own token is emitted there: the output is unchanged, only that round ends early.
DRAFT_HEAD_TOKENS = 32_768


def reduce_head(config: ModelConfig, weights, blocks: dict | None, keep: int):
    """(config, weights, blocks) of the draft with its head cut to the rows scoring target ids below `keep`
    (output_ids labels them). Unchanged where the head has no more rows than that."""
    source = "lm_head" if "lm_head" in weights else "embed"
    quantized = (blocks or {}).get(source)
    rows = quantized.shape[0] if quantized is not None else weights[source].shape[0]
    ids = weights["output_ids"] if "output_ids" in weights else torch.arange(rows)
    kept = torch.nonzero(ids < keep).squeeze(1)
    if len(kept) == rows:
        return config, weights, blocks
    config = replace(config, tie_embeddings=False)
    extra = {"output_ids": ids[kept]}
    if quantized is None:
        return config, weights | extra | {"lm_head": weights[source][kept]}, blocks
    head = quantized.rows()[kept.numpy()]
    blocks = blocks | {"lm_head": type(quantized)(quantized.kind, (len(kept), quantized.shape[1]), head)}
    return config, (weights | extra).with_blocks(blocks), blocks


def is_model_file(path: Path) -> bool:
    """A GGUF, or a Hugging Face directory (its config.json names an architecture), not one of the project's
    draft checkpoints (whose config.json holds the engine's own ModelConfig)."""
    if not path.is_dir():
        return True
    config = path / "config.json"
    return config.is_file() and "architectures" in read_json(config)


def load_draft(path: str | Path, target_path: str | Path, target_rows: int, dtype: str | None = None,
               device: str | None = None, head_tokens: int | None = DRAFT_HEAD_TOKENS):
    """A draft model file (GGUF or Hugging Face directory) as a Llama over the target's ids (`target_rows`:
    the target's embedding rows), its head cut to `head_tokens` (None: the whole vocabulary). Raises
    VocabularyMismatch for a pair that does not share a tokenizer."""
    from specpool.engine.runtime.device import default_device
    from specpool.engine.runtime.hf_loader import load_model_file
    from specpool.engine.runtime.model import Llama

    path, target_path = Path(path), Path(target_path)
    loaded = load_model_file(path)
    target_ids = draft_to_target_ids(path, loaded.config.vocab_size, target_path, target_rows)
    config, weights = map_to_target(loaded.config, loaded.weights, target_ids, target_rows)
    blocks = getattr(loaded, "blocks", None)  # a GGUF's; a moved table's rows are no longer the file's
    if blocks and config is not loaded.config:
        blocks = {name: b for name, b in blocks.items() if name not in ("embed", "lm_head")}
    if head_tokens is not None:
        config, weights, blocks = reduce_head(config, weights, blocks, head_tokens)
    return Llama(config, weights, dtype, torch.device(device) if device else default_device(), blocks=blocks)


class TargetMismatch(ValueError):
    """A distilled draft or head checkpoint loaded against a target other than the one it was trained for."""


PROBE_ROWS = 16


def embedding_probe(embed: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A few of the target's embedding rows (of tokens the draft predicts: real tokens, not padding rows), kept
    in a draft checkpoint so that a load can tell its target from another model of the same shape."""
    ids = token_ids[torch.linspace(0, len(token_ids) - 1, min(PROBE_ROWS, len(token_ids))).long()]
    return {"target_probe_ids": ids, "target_probe_rows": embed[ids].to(torch.bfloat16)}


def check_trained_for(directory: Path, meta: dict, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                      target: str | Path) -> None:
    """Raises TargetMismatch naming both models where `embed` (the target's input embeddings) is not the table
    the checkpoint in `directory` was trained with: another shape, or (where it kept a probe) other rows. The
    same model in another format passes: 4-bit blocks keep a row's cosine similarity above 0.99 (SmolLM2's,
    Q4_0 of its Q4_1 rows: 0.995), another model's rows are near 0."""
    config = meta["config"]
    trained = f"{meta.get('embeddings_from', 'another target')} ({config['vocab_size']} tokens x {config['d_model']})"
    kind = " --kind head" if config.get("feature_fed") else ""

    def refuse(why: str) -> TargetMismatch:
        return TargetMismatch(f"{directory} was trained for {trained}, not for {target} ({embed.shape[0]} tokens x "
                              f"{embed.shape[1]}): {why}; train one for this target with `specpool train-draft{kind} "
                              f"--model {target}`")

    if tuple(embed.shape) != (config["vocab_size"], config["d_model"]):
        raise refuse("the embedding tables differ in shape")
    ids, rows = weights.pop("target_probe_ids", None), weights.pop("target_probe_rows", None)
    if ids is not None:
        similarity = F.cosine_similarity(embed[ids].float(), rows.float(), dim=-1).mean().item()
        if similarity < 0.9:
            raise refuse(f"the embeddings are another model's (cosine similarity {similarity:.2f} on "
                         f"{len(ids)} tokens' rows)")
