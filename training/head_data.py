"""The feature-fed head's data: the target's own answers and its last-layer features at every position.

The text is train-draft's on-policy text (training/draft_data.py: the target answering stdlib-built
prompts). One target pass over each sequence stores its features (the last layer's hidden states
before the final norm, fp16): the head learns from them to predict the next feature, and the
teacher's next-token distribution is recomputed from the stored features while training, so no
logits are cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.engine.runtime.model import Llama


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
