"""The feature-fed head's data: the target's own answers and its last-layer features at every position.

The text is train-draft's on-policy text (training/draft_data.py: the target answering stdlib-built
prompts), optionally followed by chunks of the stdlib's own source: the soft labels are the target's
distributions at each position, not the text's tokens, so any text the target reads teaches the head,
at the cost of one target pass (generating an answer costs one pass per token). One target pass over each sequence stores its features (the last layer's hidden states
before the final norm, fp16): the head learns from them to predict the next feature, and the
teacher's next-token distribution is recomputed from the stored features while training, so no
logits are cached.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.engine.model import Llama
from specpool.engine.tokenizer import Tokenizer

# The folders training/draft_data.py's stdlib_functions skips: the prompts' functions never come from them.
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3"}


@dataclass
class FeatureCorpus:
    sequences: list[list[int]]  # prompt + answer token ids
    prompt_lens: list[int]
    features: list[torch.Tensor]  # per sequence [T, d] fp16: the target's hidden state at each position

    def save(self, path: Path) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: Path) -> FeatureCorpus:
        return cls(**torch.load(path))

    def split(self, n: int) -> tuple[FeatureCorpus, FeatureCorpus]:
        """-> (the first n sequences, the rest)."""
        fields = (self.sequences, self.prompt_lens, self.features)
        return FeatureCorpus(*(f[:n] for f in fields)), FeatureCorpus(*(f[n:] for f in fields))

    def __add__(self, other: FeatureCorpus) -> FeatureCorpus:
        return FeatureCorpus(self.sequences + other.sequences, self.prompt_lens + other.prompt_lens,
                             self.features + other.features)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def target_features(target: Llama, sequences: list[list[int]], batch_size: int = 4) -> list[torch.Tensor]:
    """The target's last-layer features at every position of every sequence, one forward per batch."""
    out = []
    cache = target.new_cache(batch_size, max(len(s) for s in sequences))
    for i in tqdm(range(0, len(sequences), batch_size), desc="target features", unit="batch"):
        batch = sequences[i : i + batch_size]
        slots = [cache.allocate() for _ in batch]
        _, hidden = target.forward(cache, slots, batch, features=True)  # [B, T, d]; logits only for the last
        out += [hidden[b, : len(seq)].to(torch.float16) for b, seq in enumerate(batch)]
        for s in slots:
            cache.release(s)
    return out


def source_chunks(tokenizer: Tokenizer, n_tokens: int, chunk: int, seed: int, exclude: list[str],
                  min_chunk: int = 64) -> list[list[int]]:
    """About n_tokens of stdlib source in chunks of up to `chunk` tokens, files in a seeded random order,
    each file chunked on its own. A function whose signature `name(args)` or source appears in one of the
    `exclude` texts (prompts held out from training) is cut from its file first, so held-out figures do
    not score text the head trained on."""
    held_out = "\0".join(exclude)
    paths = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")
                   if not SKIPPED_DIRS.intersection(p.parts))
    random.Random(seed).shuffle(paths)
    chunks, total = [], 0
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            tree = ast.parse("\n".join(lines))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        cut = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                if f"{node.name}({ast.unparse(node.args)})" in held_out or source in held_out:
                    cut.update(range(node.lineno - 1, node.end_lineno))
        ids = tokenizer.encode("\n".join(line for i, line in enumerate(lines) if i not in cut))
        for s in range(0, len(ids), chunk):
            if len(ids) - s >= min_chunk and total < n_tokens:
                chunks.append(ids[s : s + chunk])
                total += len(chunks[-1])
        if total >= n_tokens:
            break
    return chunks
