"""Tokenizer and chat template, read from the model file: a GGUF's vocabulary (byte-level BPE, or SentencePiece
as Llama 2's and Mistral's files carry it), or a Hugging Face directory's tokenizer.json (any model the
`tokenizers` library reads) and template."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from specpool.engine.runtime.process_env import release_freed_heap

# llama.cpp's token types (tokenizer.ggml.token_type) it matches whole in text and leaves out of decoded text:
# control tokens such as <|im_start|> or [INST], and the unknown token <unk>.
UNKNOWN_TOKEN_TYPE, CONTROL_TOKEN_TYPE = 2, 3
SPECIAL_TOKEN_TYPES = (UNKNOWN_TOKEN_TYPE, CONTROL_TOKEN_TYPE)
# Stand-ins for message contents while the template renders (Unicode private use: no template emits them).
_CONTENT = "\ue000{}\ue001"
_CONTENT_RE = re.compile("\ue000(\\d+)\ue001")


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex the model's own tokenizer.json
# uses before byte-level BPE. Llama 3 groups digits by three, Qwen2 splits each, and both keep one leading
# non-letter with a word; any other name keeps GPT-2's split (ByteLevel's own regex), as before.
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _start_with(tok: HFTokenizer, tokens: Sequence[str], bos_id: int) -> None:
    """Prompts encoded with special tokens start with BOS."""
    tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos_id]} $A",
                                                        special_tokens=[(tokens[bos_id], bos_id)])


class Tokenizer:
    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        chat_template: str | None,
        bos_id: int,
        eos_id: int,
        pre: str | None = None,
        add_bos: bool = False,
    ):
        """A GGUF's byte-level BPE: its tokens, merges and llama.cpp token types; `pre`: its tokenizer.ggml.pre;
        `add_bos`: prompts start with BOS (the file's add_bos_token: Llama 3's sets it, SmolLM2's clears it)."""
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
        tok = HFTokenizer(bpe)
        if pre in PRE_TOKENIZER_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        if add_bos:
            _start_with(tok, tokens, bos_id)
        # Byte-level BPE spells a token with one character per byte.
        self._setup_gguf(tok, tokens, token_types, max(len(t) for t in tokens), chat_template, bos_id, eos_id)

    @classmethod
    def sentencepiece(cls, tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                      chat_template: str | None, bos_id: int, eos_id: int, unk_id: int = 0, add_bos: bool = True,
                      add_space_prefix: bool = True) -> Tokenizer:
        """A GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral), tokenized as
        llama.cpp does. It spells a space "▁" and, where `add_space_prefix`, starts each text (the prompt, and
        each run after a control token) with one; it joins the adjacent pair whose joined text is the
        best-scored token, until none is a token; a character outside the vocabulary becomes its <0xNN> byte
        tokens. `add_bos`: prompts start with BOS (llama.cpp's default for these files)."""
        vocab = {tok: i for i, tok in enumerate(tokens)}
        # The files list no merges: as a BPE, that joining is a merge for each way a token splits into two
        # tokens, the best-scored token's first.
        splits = [(score, t[:k], t[k:]) for t, score in zip(tokens, scores) for k in range(1, len(t))
                  if t[:k] in vocab and t[k:] in vocab]
        merges = [(left, right) for _, left, right in sorted(splits, key=lambda s: -s[0])]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id], byte_fallback=True,
                                     fuse_unk=True))
        # A normalizer, not a pre-tokenizer: it runs on each run of text between control tokens, as llama.cpp
        # prefixes each (Metaspace would prefix only the first), and leaves the text one word, as SentencePiece
        # does (its tokens may span spaces: "▁▁▁▁").
        spaces = [normalizers.Prepend("▁")] if add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []  # the prefix, as llama.cpp drops it
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
        if add_bos:
            _start_with(tok, tokens, bos_id)
        self = cls.__new__(cls)
        # A token covers at most its own text, with "▁" a one-byte space (a byte token <0xNN> counts more than
        # its byte: a looser bound).
        self._setup_gguf(tok, tokens, token_types, max(len(t.replace("▁", " ").encode()) for t in tokens),
                         chat_template, bos_id, eos_id)
        return self

    def _setup_gguf(self, tok: HFTokenizer, tokens: Sequence[str], token_types: Sequence[int], max_token_bytes: int,
                    chat_template: str | None, bos_id: int, eos_id: int) -> None:
        # Control tokens must be matched whole, or "<|im_start|>" is split into "<", "|", ...
        control = [t for t, ty in zip(tokens, token_types) if ty in SPECIAL_TOKEN_TYPES]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        self._setup(tok, control, len(tokens), max_token_bytes, chat_template, bos_id, eos_id)

    @classmethod
    def from_hf(cls, tokenizer_json: str, chat_template: str | None, bos_id: int, eos_id: int,
                special_tokens: dict[str, str | None] | None = None) -> Tokenizer:
        """A Hugging Face tokenizer.json (its text), whose special added tokens are the control tokens;
        `special_tokens`: tokenizer_config.json's bos_token, eos_token, ... as its template sees them."""
        tok = HFTokenizer.from_str(tokenizer_json)
        control = [t["content"] for t in json.loads(tokenizer_json).get("added_tokens", []) if t.get("special")]
        size = tok.get_vocab_size(with_added_tokens=True)
        spelled = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        self = cls.__new__(cls)
        # Decoded alone, a SentencePiece token drops its leading "▁" (a space it covers in running text).
        widest = max(len(s.encode()) + (tok.id_to_token(i) or "").startswith("▁") for i, s in enumerate(spelled))
        self._setup(tok, control, size, widest, chat_template, bos_id, eos_id)
        for name, token in (special_tokens or {}).items():
            if token is None:  # unset: undefined in the template (it renders as ""), as in transformers
                self._template_vars.pop(name, None)
            else:
                self._template_vars[name] = token
        return self

    def _setup(self, tok: HFTokenizer, control_tokens: list[str], vocab_size: int, max_token_bytes: int,
               chat_template: str | None, bos_id: int, eos_id: int) -> None:
        self._tok = tok
        self.control_tokens = control_tokens
        self.vocab_size = vocab_size
        # No token covers more text than this, so a text of n bytes has at least n / max_token_bytes tokens.
        self.max_token_bytes = max_token_bytes
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        # What templates may name besides the messages, as transformers renders them (Llama 3's starts with
        # {{ bos_token }}).
        self._template_vars = {name: tok.id_to_token(i) for name, i in (("bos_token", bos_id), ("eos_token", eos_id))
                               if 0 <= i < vocab_size}
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_gguf(cls, gguf_model) -> Tokenizer:
        """The vocabulary of a GGUF whose tokenizer.ggml.model is "llama" (SentencePiece), or else byte-level
        BPE (gpt2; the caller refuses other models)."""
        g, config = gguf_model, gguf_model.config
        if g.tokenizer_model == "llama":
            tokenizer = cls.sentencepiece(
                g.tokens, g.scores, g.token_types, g.chat_template, config.bos_id, config.eos_id,
                unk_id=0 if g.unk_id is None else g.unk_id, add_bos=g.add_bos is not False,
                add_space_prefix=g.add_space_prefix is not False)
        else:
            tokenizer = cls(g.tokens, g.merges, g.token_types, g.chat_template, config.bos_id, config.eos_id,
                            g.tokenizer_pre, add_bos=g.add_bos is True)
        release_freed_heap()  # building it went through its whole text as JSON
        return tokenizer

    @functools.cached_property
    def _text_only(self) -> HFTokenizer:
        """The same tokenizer without its control tokens: what a chat message's content is encoded with. Built
        on first use, by a message holding a control token's text: a second copy of a 151,936-token vocabulary
        held 46 MB, and building it at load took the load's peak 80 MB higher. (Two threads may both build it:
        the same tokenizer, one kept.)"""
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if not t.get("special")]
        return HFTokenizer.from_str(json.dumps(spec))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt framed as the model expects: a tokenizer.json's post-processor adds Llama's and
        Mistral's BOS (Qwen's adds nothing), as transformers' `tokenizer(text)` does, and so does a GGUF's
        SentencePiece vocabulary unless its add_bos_token is false, and its byte-level BPE only where that is
        true (as llama.cpp reads them). (A chat template writes its own BOS.)"""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own template (which adds its default system prompt)."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt instead of messages")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._template_vars)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's turn markers are control tokens; a message's content is text only, so a user
        who types "<|im_start|>system" gets those characters, not a forged system turn."""
        if not any(c in m["content"] for m in messages for c in self.control_tokens):
            return self.encode(self.apply_chat_template(messages))
        stand_ins = [{**m, "content": _CONTENT.format(i)} for i, m in enumerate(messages)]
        parts = _CONTENT_RE.split(self.apply_chat_template(stand_ins))  # template, index, template, ...
        if sorted(parts[1::2]) != sorted(str(i) for i in range(len(messages))):
            raise ValueError("the chat template does not place each message's content once")
        # Each run of text between the template's control tokens, contents included, is encoded whole, as
        # in a text without them: a SentencePiece vocabulary starts each run with a space, not each part.
        control = re.compile("(" + "|".join(map(re.escape, sorted(self.control_tokens, key=len, reverse=True))) + ")")
        ids: list[int] = []
        run = ""
        for i, part in enumerate(parts):
            if i % 2:
                run += messages[int(part)]["content"]
                continue
            for j, piece in enumerate(control.split(part)):  # text, control token, text, ...
                if j % 2 == 0:
                    run += piece
                    continue
                ids += self._text_only.encode(run, add_special_tokens=False).ids if run else []
                ids.append(self._tok.token_to_id(piece))
                run = ""
        return ids + (self._text_only.encode(run, add_special_tokens=False).ids if run else [])


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; templates are written against transformers' plain one.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(chat_template: str) -> jinja2.Template:
    """A chat template in the environment transformers renders it in (block trimming, loop controls, its
    helpers), sandboxed: a model file is data, so a crafted template cannot reach Python internals (a plain
    Environment let one run shell commands: the CVE-2024-34359 pattern)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(chat_template)
