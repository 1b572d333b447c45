"""The feature-fed head's data: the target's own answers and its last-layer features at every position.

The target answers prompts (training/draft_data.py: code and chat built from the installed Python
and from templates) with continuous batching, the way a server decodes: a finished sequence's slot
takes the next prompt at once. The features come from those same forwards (`FeatureRecorder`, a
drafter that only listens), so no second pass over the text is needed and they carry the serving
format's numerics. Finished sequences are written in shards; a rerun resumes with the prompts no
shard holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.engine.decoding import Decoder, GenerationResult
from specpool.engine.drafters.base import Capabilities, Drafter, Drafts
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams


@dataclass
class FeatureCorpus:
    sequences: list[list[int]]  # prompt + answer token ids
    prompt_lens: list[int]
    features: list[torch.Tensor]  # per sequence [T, d] fp16: the target's hidden state at each position
    seconds: float = 0.0  # the data pass's time, every run's (record_features)

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
    def tokens_per_hour(self) -> float:
        return self.num_tokens / self.seconds * 3600 if self.seconds else 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


class FeatureRecorder(Drafter):
    """A drafter that never drafts: it reads the features the decoder hands a feature-fed head, for
    every position the target was fed (the prompt at prefill, then each emitted token)."""

    caps = Capabilities(features=True)

    def __init__(self):
        self.features: dict[str, list[torch.Tensor]] = {}

    def start(self, seq_id, context, features):
        self.features[seq_id] = [features.to(torch.float16)]

    def observe(self, seq_id, tokens, features):
        self.features[seq_id].append(features.to(torch.float16))

    def propose(self, seq_ids, num_tokens, params, generator):
        return Drafts.empty(len(seq_ids))

    def release(self, seq_id):
        pass  # record_features takes the finished sequence's features (pop)

    def pop(self, seq_id: str) -> torch.Tensor | None:
        """A finished sequence's features; None for one that ended at prefill (never started here)."""
        parts = self.features.pop(seq_id, None)
        return torch.cat(parts) if parts else None


def answer_params(index: int, seed: int) -> SamplingParams:
    """Every other prompt greedy, the rest sampled as chat is (T 0.8, top-p 0.95), all from one stream
    (one sampling group in the batch, not one per sequence)."""
    return SamplingParams() if index % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.95, seed=seed)


def record_features(target: Llama, prompts: Sequence[list[int]], shard_dir: Path, seconds: float,
                    batch_size: int = 32, max_new_tokens: int = 192, seed: int = 0,
                    shard_tokens: int = 100_000) -> FeatureCorpus:
    """Answers `prompts` in order, `batch_size` at a time, until `seconds` are spent (in total, the shards
    already written included) or every prompt is answered; writes each ~`shard_tokens` of finished
    sequences to shard_dir/shard-NNNNN.pt and returns every shard's sequences. A sequence's features stop
    one position short of its end: the target was never fed its last token, and the step that emitted
    its stop token hands the decoder nothing more."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    written = [torch.load(path, mmap=True) for path in _shards(shard_dir)]
    done = {i for shard in written for i in shard["prompt_ids"]}
    seconds -= sum(shard["seconds"] for shard in written)
    del written
    todo = [i for i in range(len(prompts)) if i not in done]
    recorder = FeatureRecorder()
    max_len = max(len(prompts[i]) for i in todo) + max_new_tokens + 1 if todo else 1
    decoder = Decoder(target, batch_size, max_len, recorder)
    running: dict[str, tuple[int, GenerationResult]] = {}
    shard = {"prompt_ids": [], "sequences": [], "prompt_lens": [], "features": [], "seconds": 0.0}
    deadline = time.monotonic() + seconds
    bar = tqdm(total=len(prompts), initial=len(done), desc="answers with features", unit="seq")
    tokens = shard_held = 0
    start = last_write = time.monotonic()
    while todo or running:
        while todo and decoder.free_slots > 0 and time.monotonic() < deadline:
            i = todo.pop(0)
            running[str(i)] = (i, decoder.add(str(i), prompts[i], answer_params(i, seed), max_new_tokens))
        if not decoder.has_work:
            break
        decoder.step()
        for seq_id in [s for s, (_, result) in running.items() if result.finish_reason]:
            i, result = running.pop(seq_id)
            sequence = prompts[i] + result.token_ids
            features = recorder.pop(seq_id)
            if result.finish_reason == "error" or features is None or len(features) < len(prompts[i]) + 1:
                continue
            shard["prompt_ids"].append(i)
            shard["sequences"].append(sequence[: len(features)])
            shard["prompt_lens"].append(len(prompts[i]))
            shard["features"].append(features)
            tokens += len(features)
            shard_held += len(features)
            bar.update(1)
            bar.set_postfix(tokens_per_hour=f"{tokens / (time.monotonic() - start) * 3600 / 1e6:.2f}M")
            if shard_held >= shard_tokens:
                shard["seconds"], last_write = time.monotonic() - last_write, time.monotonic()
                _write_shard(shard_dir, shard)
                shard_held = 0
    if shard["prompt_ids"]:
        shard["seconds"] = time.monotonic() - last_write
        _write_shard(shard_dir, shard)
    bar.close()
    return load_shards(shard_dir)


def _shards(shard_dir: Path) -> list[Path]:
    return sorted(shard_dir.glob("shard-*.pt"))


def _write_shard(shard_dir: Path, shard: dict) -> None:
    shards = _shards(shard_dir)
    path = shard_dir / f"shard-{int(shards[-1].stem[6:]) + 1 if shards else 0:05d}.pt"  # after the last: none overwritten
    torch.save(shard, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # a shard appears whole or not at all
    for field in ("prompt_ids", "sequences", "prompt_lens", "features"):
        shard[field].clear()


def load_shards(shard_dir: Path) -> FeatureCorpus:
    corpus = FeatureCorpus([], [], [])
    for path in _shards(shard_dir):
        shard = torch.load(path)
        corpus.sequences += shard["sequences"]
        corpus.prompt_lens += shard["prompt_lens"]
        corpus.features += shard["features"]
        corpus.seconds += shard["seconds"]
    return corpus
