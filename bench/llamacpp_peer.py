"""llama.cpp as a bench peer: the same GGUF file (its own Q4_1 / Q8_0 blocks), the same prompts, the
same cores, through llama-cpp-python's bindings of llama.cpp's C API (a bench-only dependency:
`make bench-deps` builds it from PyPI's source for this machine's CPU).

Two modes, each for a whole chunk of prompts at once, the way llama-server decodes its parallel
slots: every sequence of the chunk is one llama.cpp sequence id, and each step is one `llama_decode`
call with a row per active sequence (so batch 16 is llama.cpp's own batched decoding, not 16 runs).

* AR (`llamacpp-ar`): one token per sequence per step.
* Prompt lookup (`llamacpp-lookup`): each sequence drafts up to `lookup` tokens with the package's
  `LlamaPromptLookupDecoding` (the n-gram match of llama-cpp-python's own speculative decoding) and one
  step verifies the drafts of every sequence. A draft token is kept while it equals the token the
  target picks at its position (its argmax, or its sample at temperature > 0), so the output is the
  target's own: lossless without needing a draft distribution.

Both stop a sequence at an end-of-generation token (kept; llama.cpp's own set for the model, as its
tools stop) or after `max_new_tokens`; `stop=False` decodes on through them (bench/ar_speed.py's
fixed-length runs).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from specpool.bench.peers import PeerRun

# llama.cpp's kernels change with the row count (a verify step's rows are not computed as a decode
# step's), so its lookup's greedy picks may differ from its AR's where the top-2 logits are this close.
# On HumanEval's first 40 (128 tokens, batch 1) one prompt departed, at token 107, where the 11-row
# forward's top-2 gap was 0.18 and the 1-row step picked the other token.
NEAR_TIE = 0.5
CONTEXT_PER_SEQUENCE = 2048  # prompt + new tokens + one step's drafts, per sequence
_log_callback = None


def quiet(lc) -> None:
    """Initializes llama.cpp with its log silenced: its load log would drown the bench's table."""
    global _log_callback
    lc.llama_backend_init()
    if _log_callback is None:  # llama.cpp keeps the pointer: the callback must live as long as the process
        _log_callback = lc.llama_log_callback(lambda level, text, user_data: None)
        lc.llama_log_set(_log_callback, ctypes.c_void_p())


class LlamaCpp:
    """A llama.cpp model and context for up to `sequences` prompts at once on `threads` threads."""

    def __init__(self, gguf: str | Path, threads: int, sequences: int = 16):
        import llama_cpp as lc

        self.lc = lc
        quiet(lc)
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = CONTEXT_PER_SEQUENCE * sequences
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.sequences = sequences
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        # The model's end-of-generation tokens as llama.cpp's tools see them (Qwen's are not SmolLM2's id 2).
        self.eog = frozenset(t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(vocab, t))
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)
        self.batch_capacity = params.n_batch
        self.drafted = self.accepted = 0  # prompt lookup's draft tokens so far, and those the target kept

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, lookup: int = 0, stop: bool = True) -> PeerRun:
        """New tokens per prompt (prompt order), decoded `self.sequences` prompts at a time; `lookup` > 0
        drafts up to that many tokens per sequence per step by prompt lookup."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        rng = np.random.default_rng(seed)
        outputs, seconds = [], 0.0
        for start in range(0, len(prompts), self.sequences):
            chunk = prompts[start : start + self.sequences]
            self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
            began = time.perf_counter()
            outputs += self._decode(chunk, max_new_tokens, temperature, rng, lookup, stop, LlamaPromptLookupDecoding)
            seconds += time.perf_counter() - began
        return PeerRun(outputs, seconds, sum(len(o) for o in outputs))

    def _decode(self, prompts, max_new_tokens, temperature, rng, lookup, stop, lookup_drafter) -> list[list[int]]:
        history = [list(p) for p in prompts]  # each sequence's tokens, prompt included
        out: list[list[int]] = [[] for _ in prompts]
        # Prefill: every prompt's tokens; the logits of each prompt's last one pick its first token.
        rows = [(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        firsts = self._run(rows)
        pending = {s: self._pick(logits, temperature, rng) for (s, *_), logits in firsts}
        while pending:
            steps = []
            for s, token in pending.items():
                out[s].append(token)
                history[s].append(token)
                if len(out[s]) >= max_new_tokens or (stop and token in self.eog):
                    continue
                room = max_new_tokens - len(out[s]) - 1
                draft = []
                if lookup and room:
                    draft = lookup_drafter.find_candidate_pred_tokens(
                        np.asarray(history[s], dtype=np.intc), 2, min(lookup, room)).tolist()
                    self.drafted += len(draft)
                steps.append((s, [token] + draft))
            pending = {}
            rows = [(s, len(history[s]) - 1 + i, t, True) for s, tokens in steps for i, t in enumerate(tokens)]
            logits = iter(self._run(rows))
            for s, tokens in steps:
                picked = [self._pick(next(logits)[1], temperature, rng) for _ in tokens]
                # Keep each draft token the target picked too; the first pick that differs is the target's own.
                kept = 0
                while kept < len(tokens) - 1 and tokens[kept + 1] == picked[kept]:
                    kept += 1
                accepted = picked[: kept + 1]
                self.accepted += kept
                if kept < len(tokens) - 1:  # the cache holds rejected drafts past the kept ones: drop them
                    self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), s, len(history[s]) + kept, -1)
                for token in accepted[:-1]:
                    out[s].append(token)
                    history[s].append(token)
                    if len(out[s]) >= max_new_tokens or (stop and token in self.eog):
                        break
                else:
                    pending[s] = accepted[-1]
        return out

    def next_logits(self, tokens: list[int]) -> np.ndarray:
        """The logits after `tokens`, fed from an empty cache at once (a prefill)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        [(_, logits)] = self._run([(0, i, t, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        return logits

    def divergence_gap(self, prompt: list[int], ref: list[int], out: list[int]) -> float:
        """The top-2 logit gap where `out` first departs from the greedy `ref` (or ends early)."""
        i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        top = np.sort(self.next_logits(prompt + ref[:i]))[-2:]
        return float(top[1] - top[0])

    def step_costs(self, draft_lens: list[int], context_len: int = 128, repeats: int = 5) -> list[float]:
        """T(1, K) for each K of `draft_lens`: the best of `repeats` seconds of one decode call feeding K+1
        tokens (logits for each) to a sequence holding `context_len`, as engine/policy/costs.py
        measures ours."""
        memory = self.lc.llama_get_memory(self.ctx)
        self.lc.llama_memory_clear(memory, True)
        self._run([(0, i, 100 + i, False) for i in range(context_len)])
        out = []
        for k in draft_lens:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._run([(0, context_len + i, 5 + i, True) for i in range(k + 1)])
                times.append(time.perf_counter() - start)
                self.lc.llama_memory_seq_rm(memory, 0, context_len, -1)
            out.append(min(times))
        return out

    def _run(self, rows: list[tuple[int, int, int, bool]]) -> list[tuple[tuple, np.ndarray]]:
        """Decodes rows (sequence, position, token, wants logits) in batches; the logits of the rows
        that want them, in row order."""
        out = []
        for start in range(0, len(rows), self.batch_capacity):
            part = rows[start : start + self.batch_capacity]
            b = self.batch
            for i, (s, pos, token, logits) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
                b.seq_id[i][0] = s
            b.n_tokens = len(part)
            if (status := self.lc.llama_decode(self.ctx, b)) != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            for i, row in enumerate(part):
                if row[3]:
                    ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                    out.append((row, np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()))
        return out

    @staticmethod
    def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return int(rng.choice(len(p), p=p / p.sum()))
