"""On-policy distillation data: the target's own answers to prompts built from Python's stdlib.

The stdlib ships with every Python, so the data needs no download, and it is disjoint from the
benchmark workloads (HumanEval). Prompts come in three shapes: a bare signature + docstring to
complete (code completion), a chat request to write a function from its docstring, and a chat
request to explain a piece of stdlib source. The target answers greedily and by sampling; a
teacher pass then stores its top-k log-probabilities at every position, computed once.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.engine.decoding import generate
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.tokenizer import Tokenizer
from specpool.engine.verification.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class StdlibFunction:
    name: str
    args: str
    docstring: str
    source: str


def stdlib_functions(max_source_chars: int = 1500) -> list[StdlibFunction]:
    """Documented functions of the stdlib, found by parsing (never importing) its sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3"} for part in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
            lines = text.splitlines()
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            if doc and 20 <= len(doc) <= 800 and len(source) <= max_source_chars:
                found.append(StdlibFunction(node.name, ast.unparse(node.args), doc.strip(), source))
    return found


def build_prompts(functions: list[StdlibFunction], tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for fn in functions:
        shape = rng.random()
        if shape < 0.5:
            doc = fn.docstring.replace('"""', "'''")
            indented = "\n    ".join(doc.splitlines())
            prompts.append(tokenizer.encode(f'def {fn.name}({fn.args}):\n    """{indented}\n    """\n'))
        elif shape < 0.8:
            first = fn.docstring.split("\n\n")[0].replace("\n", " ")
            ask = f"Write a Python function `{fn.name}({fn.args})`. {first}"
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": ask}]))
        else:
            ask = f"Explain what this Python code does.\n```python\n{fn.source}\n```"
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": ask}]))
    rng.shuffle(prompts)
    return prompts


@dataclass
class Corpus:
    sequences: list[list[int]]  # prompt + answer token ids
    prompt_lens: list[int]
    teacher_ids: list[torch.Tensor]  # per sequence [T, k] int32: top-k next-token ids at each position
    teacher_logprobs: list[torch.Tensor]  # per sequence [T, k] fp16

    def save(self, path: Path) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        return cls(**torch.load(path))

    def split(self, n: int) -> tuple[Corpus, Corpus]:
        """-> (the first n sequences, the rest)."""
        fields = (self.sequences, self.prompt_lens, self.teacher_ids, self.teacher_logprobs)
        return Corpus(*(f[:n] for f in fields)), Corpus(*(f[n:] for f in fields))

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def generate_answers(
    target: Llama,
    prompts: list[list[int]],
    seconds: float,
    batch_size: int,
    max_new_tokens: int,
    seed: int,
    max_prompt_tokens: int = 320,
) -> tuple[list[list[int]], list[int]]:
    """Answer prompts in batches until the time budget is spent; alternate greedy and sampled batches."""
    # Batches of similar length: a ragged prefill pads every row to the longest one.
    prompts = [p for p in prompts if len(p) <= max_prompt_tokens]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [[prompts[i] for i in order[j : j + batch_size]] for j in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(batches)
    sequences, prompt_lens = [], []
    deadline = time.monotonic() + seconds
    bar = tqdm(total=int(seconds), desc="target answers (s)", unit="s")
    start = time.monotonic()
    for i, batch in enumerate(batches):
        if time.monotonic() >= deadline:
            break
        greedy = i % 2 == 0
        params = SamplingParams() if greedy else SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i)
        for prompt, result in zip(batch, generate(target, batch, params, max_new_tokens)):
            sequences.append(prompt + result.token_ids)
            prompt_lens.append(len(prompt))
        bar.update(int(time.monotonic() - start) - bar.n)
        bar.set_postfix(sequences=len(sequences), tokens=sum(map(len, sequences)))
    bar.close()
    return sequences, prompt_lens


def teacher_topk(
    target: Llama, sequences: list[list[int]], k: int, batch_size: int = 4
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The target's top-k next-token log-probabilities at every position, one forward per batch."""
    ids_out, logprobs_out = [], []
    max_len = max(len(s) for s in sequences)
    cache = target.new_cache(batch_size, max_len)
    for i in tqdm(range(0, len(sequences), batch_size), desc="teacher top-k", unit="batch"):
        batch = sequences[i : i + batch_size]
        slots = [cache.allocate() for _ in batch]
        logits = target.forward(cache, slots, batch, all_logits=True)  # [B, T, V]
        top = torch.topk(logits.log_softmax(-1), k, dim=-1)
        for b, seq in enumerate(batch):
            ids_out.append(top.indices[b, : len(seq)].to(torch.int32))
            logprobs_out.append(top.values[b, : len(seq)].to(torch.float16))
        for s in slots:
            cache.release(s)
    return ids_out, logprobs_out
