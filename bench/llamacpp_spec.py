"""llama.cpp's own draft-model speculation as a bench peer (`llamacpp-sd[:N]`): its `llama-speculative-simple`
example (built for this machine by bench/llamacpp_build.py), the target and the draft GGUF files, one process
per prompt, greedy, drafting up to N tokens a step (`--spec-draft-n-max`, default 4) with `--spec-type
draft-simple` and llama.cpp's other defaults.

What goes in and what is read back, since the binary speaks text:
* The prompt goes in as text (it takes no token ids): our prompt ids rendered by llama.cpp's own vocabulary,
  which the binary tokenizes again. `generate` checks that this gives back the same ids (it does for HumanEval
  on the Qwen pair) and says on stderr where it does not.
* It prints the generated text only, piece by piece after echoing the prompt. The text is re-tokenized with the
  target's vocabulary (llama.cpp's), so its ids may split the text otherwise than the tokens it decoded, and
  the bench compares its output with llamacpp-ar's as text (`Vocab.same_output`). An end-of-generation token
  is not printed: where the text re-tokenizes to fewer than max_tokens tokens it ended at one, and the
  vocabulary's EOS stands for whichever it met.
* Length: its loop stops once n_predict > -n, so it is given max_tokens - 1; and a step whose budget is down
  to 0 drafts a full N (speculative.cpp caps a draft at the budget only while the budget is > 0), so it
  decodes max_tokens to max_tokens + N tokens. The output is cut to max_tokens (re-tokenized) tokens.
* Time and tokens: its own "encoded" seconds (the prompt, into target and draft) plus its "decoded" seconds,
  over its own n_predict (every token it decoded, the count its decode speed is of). Neither time counts
  loading the models or starting the process, and together they time what the other modes' clocks time,
  llamacpp-ar's included: prefill and decoding. Each prompt's report stays in `runs` (decode-only speed,
  drafts, acceptance).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specpool.bench.peers import PeerRun

ECHO_START = b"\n\n"  # printed before the prompt's pieces
TAIL = b"\n\n\n\n"  # printed after the last new token (twice "\n\n")
_STATS = {
    "encode": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decode": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "n_draft": re.compile(r"n_draft\s+=\s+(\d+)"),
    "n_predict": re.compile(r"n_predict\s+=\s+(\d+)"),
    "n_drafted": re.compile(r"n_drafted\s+=\s+(\d+)"),
    "n_accept": re.compile(r"n_accept\s+=\s+(\d+)"),
}


@dataclass(frozen=True)
class SpecOutput:
    """One run of llama-speculative-simple, as it reported it."""

    text: bytes  # the new tokens' pieces (UTF-8, possibly cut inside a character at a limit)
    prompt_tokens: int
    encode_s: float  # the prompt into target and draft
    decode_s: float  # every new token: drafting, verifying, sampling
    draft_max: int
    n_predict: int  # new tokens
    n_drafted: int
    n_accept: int

    @property
    def target_steps(self) -> int:
        """Target forwards over the new tokens: each one keeps its accepted drafts and one token of its own."""
        return self.n_predict - self.n_accept

    @property
    def acceptance(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0


def parse_output(stdout: bytes, stderr: str, echo: bytes) -> SpecOutput:
    """The generated text of `stdout` (after `echo`, the prompt's pieces as it prints them) and the counts and
    times of its report on `stderr`."""
    start = ECHO_START + echo
    if not stdout.startswith(start):
        raise ValueError(f"llama-speculative-simple's output does not begin with the prompt it was given: "
                         f"{stdout[:120]!r}")
    if not stdout.endswith(TAIL) or len(stdout) < len(start) + len(TAIL):
        raise ValueError(f"llama-speculative-simple's output does not end as a finished run's: {stdout[-120:]!r}")
    found = {}
    for name, pattern in _STATS.items():
        if (m := pattern.search(stderr)) is None:
            raise ValueError(f"no {name!r} line in llama-speculative-simple's report:\n{stderr[-2000:]}")
        found[name] = m.groups()
    (prompt_tokens, encode_s), (n_predict, decode_s) = found["encode"], found["decode"]
    if int(n_predict) != int(found["n_predict"][0]):
        raise ValueError(f"llama-speculative-simple decoded {n_predict} tokens but reports n_predict "
                         f"{found['n_predict'][0]}")
    return SpecOutput(stdout[len(start) : len(stdout) - len(TAIL)], int(prompt_tokens), float(encode_s),
                      float(decode_s), int(found["n_draft"][0]), int(n_predict), int(found["n_drafted"][0]),
                      int(found["n_accept"][0]))


class Vocab:
    """A model's vocabulary alone, through llama-cpp-python: llama.cpp's own tokenization and pieces."""

    def __init__(self, gguf: str | Path):
        import llama_cpp as lc

        from specpool.bench.llamacpp_peer import quiet

        self.lc = lc
        quiet(lc)
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {gguf}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.eos = lc.llama_vocab_eos(self.vocab)
        self.bos = lc.llama_vocab_bos(self.vocab)
        self.adds_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        n = lc.llama_vocab_n_tokens(self.vocab)
        self.eog = frozenset(t for t in range(n) if lc.llama_vocab_is_eog(self.vocab, t))

    def close(self) -> None:
        self.lc.llama_model_free(self.model)

    def tokenize(self, text: bytes, add_special: bool) -> list[int]:
        """Special tokens' text parsed as those tokens, as the binary tokenizes its prompt."""
        buf = (self.lc.llama_token * (len(text) + 2))()
        n = self.lc.llama_tokenize(self.vocab, text, len(text), buf, len(buf), add_special, True)
        if n < 0:
            raise RuntimeError(f"llama.cpp could not tokenize {len(text)} bytes ({n})")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """A token's bytes as the binary prints them (special tokens rendered)."""
        buf = ctypes.create_string_buffer(64)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:  # longer: -n is its length
            buf = ctypes.create_string_buffer(-n)
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def text(self, tokens: list[int]) -> bytes:
        """The tokens' bytes, end-of-generation tokens left out."""
        return b"".join(self.piece(t) for t in tokens if t not in self.eog)

    def same_output(self, a: list[int], b: list[int]) -> bool:
        """Whether two outputs of at most as many tokens are the same continuation as text: both ended at an
        end-of-generation token with the same text, or neither did and one's text begins the other's (the
        token limit cuts re-tokenized text elsewhere)."""
        ended_a, ended_b = (bool(x) and x[-1] in self.eog for x in (a, b))
        text_a, text_b = self.text(a), self.text(b)
        if ended_a or ended_b:
            return ended_a == ended_b and text_a == text_b
        return text_a.startswith(text_b) or text_b.startswith(text_a)


class LlamaCppSpeculative:
    """llama-speculative-simple on `target` drafted by `draft`, `threads` threads each (they take turns)."""

    def __init__(self, target: str | Path, draft: str | Path, threads: int):
        from specpool.bench import llamacpp_build

        for role, path in (("target", target), ("draft", draft)):
            if Path(path).suffix != ".gguf" or not Path(path).is_file():
                raise FileNotFoundError(f"llamacpp-sd needs the {role} as a GGUF file; {path} is not one")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self.target, self.draft, self.threads = str(target), str(draft), threads
        self.binary = llamacpp_build.speculative_binary()
        self.vocab = Vocab(target)
        self.runs: list[SpecOutput] = []  # every prompt's report so far

    def close(self) -> None:
        self.vocab.close()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, draft_max: int = 4) -> PeerRun:
        """Each prompt alone (the binary decodes one sequence), greedy; the new tokens of each (re-tokenized
        text cut to max_new_tokens, or ended by the vocabulary's EOS where it stopped short) and llama.cpp's own
        seconds and count."""
        outputs, seconds, tokens = [], 0.0, 0
        for prompt in prompts:
            run = self.run(prompt, max_new_tokens, draft_max)
            ids = self.vocab.tokenize(run.text, add_special=False)
            outputs.append(ids[:max_new_tokens] if len(ids) >= max_new_tokens else ids + [self.vocab.eos])
            seconds += run.encode_s + run.decode_s
            tokens += run.n_predict
        return PeerRun(outputs, seconds, tokens)

    def run(self, prompt: list[int], max_new_tokens: int, draft_max: int) -> SpecOutput:
        """One prompt through the binary."""
        if not prompt:
            raise ValueError("llamacpp-sd needs a prompt of at least one token")
        if max_new_tokens < 1 or draft_max < 1:
            raise ValueError(f"max_new_tokens and the draft length must be at least 1 ({max_new_tokens}, {draft_max})")
        # It adds BOS itself where the model asks for one: a BOS of ours would come out twice.
        body = prompt[1:] if self.vocab.adds_bos and prompt[0] == self.vocab.bos else prompt
        text = b"".join(self.vocab.piece(t) for t in body)
        if (theirs := self.vocab.tokenize(text, add_special=True)) != prompt:
            print(f"llamacpp-sd: llama.cpp tokenizes a {len(prompt)}-token prompt's text as {len(theirs)} other "
                  f"tokens: it continues that text, not those tokens", file=sys.stderr)
        echo = b"".join(self.vocab.piece(t) for t in theirs)
        context = -(-(len(theirs) + max_new_tokens + 2 * draft_max + 16) // 256) * 256  # it may run N past the limit
        threads = str(self.threads)
        with tempfile.NamedTemporaryFile(suffix=".txt") as f:
            f.write(text + b"\n")  # -f drops a file's last newline
            f.flush()
            command = [str(self.binary), "-m", self.target, "-md", self.draft, "--spec-type", "draft-simple",
                       "--spec-draft-n-max", str(draft_max), "-f", f.name, "--no-escape",
                       "-n", str(max_new_tokens - 1), "--temp", "0", "--top-k", "1",
                       "-t", threads, "-tb", threads, "-td", threads, "-tbd", threads,
                       "-c", str(context), "-b", str(context), "--color", "off"]
            done = subprocess.run(command, check=False, capture_output=True)
        stderr = done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"llama-speculative-simple exited with {done.returncode}:\n{stderr[-3000:]}")
        run = parse_output(done.stdout, stderr, echo)
        self.runs.append(run)
        return run
