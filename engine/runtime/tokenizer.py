"""Byte-level BPE tokenizer and chat template, both read from the GGUF itself."""

from __future__ import annotations

import re
from collections.abc import Sequence

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL_TOKEN_TYPE = 3  # llama.cpp's token_type for control tokens such as <|im_start|>
# Stand-ins for message contents while the template renders (Unicode private use: no template emits them).
_CONTENT = "\ue000{}\ue001"
_CONTENT_RE = re.compile("\ue000(\\d+)\ue001")


class Tokenizer:
    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        chat_template: str | None,
        bos_id: int,
        eos_id: int,
    ):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
        self._tok = HFTokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        # The same BPE without control tokens: what a chat message's content is encoded with.
        self._text_only = HFTokenizer.from_str(self._tok.to_str())
        # Control tokens must be matched whole, or "<|im_start|>" is split into "<", "|", ...
        self.control_tokens = [tok for tok, ty in zip(tokens, token_types) if ty == CONTROL_TOKEN_TYPE]
        self._tok.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in self.control_tokens])
        self.vocab_size = len(tokens)
        # Byte-level BPE spells a token with one character per byte: no token covers more text than this,
        # so a text of n bytes has at least n / max_token_bytes tokens.
        self.max_token_bytes = max(len(tok) for tok in tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        # A model file is data: its template renders in a sandbox, so a crafted one cannot reach Python
        # internals (a plain Environment let one run shell commands: the CVE-2024-34359 pattern).
        self._template = (
            ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(chat_template)
            if chat_template
            else None
        )

    @classmethod
    def from_gguf(cls, gguf_model) -> Tokenizer:
        return cls(
            gguf_model.tokens,
            gguf_model.merges,
            gguf_model.token_types,
            gguf_model.chat_template,
            gguf_model.config.bos_id,
            gguf_model.config.eos_id,
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own template (which adds its default system prompt)."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt instead of messages")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's turn markers are control tokens; a message's content is text only, so a user
        who types "<|im_start|>system" gets those characters, not a forged system turn."""
        if not any(c in m["content"] for m in messages for c in self.control_tokens):
            return self.encode(self.apply_chat_template(messages))
        stand_ins = [{**m, "content": _CONTENT.format(i)} for i, m in enumerate(messages)]
        parts = _CONTENT_RE.split(self.apply_chat_template(stand_ins))  # template, index, template, ...
        if sorted(parts[1::2]) != sorted(str(i) for i in range(len(messages))):
            raise ValueError("the chat template does not place each message's content once")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._text_only.encode(messages[int(part)]["content"], add_special_tokens=False).ids
            elif part:
                ids += self.encode(part)
        return ids
