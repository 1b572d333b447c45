"""The shipped chat workload: enough short instruction prompts, of several kinds, none of them code."""

import json

from specpool.bench.workloads import CHAT, load_workload
from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
from specpool.engine.runtime.tokenizer import Tokenizer


def test_chat_workload_is_short_instructions_of_several_kinds():
    items = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()]
    assert len(items) >= 30
    kinds = {item["kind"] for item in items}
    assert len(kinds) >= 10, kinds
    texts = [m["content"] for item in items for m in item["messages"]]
    assert not any(word in text for text in texts for word in ("def ", "```", "import ", "return ")), "chat, not code"
    tokenizer = Tokenizer.from_gguf(load_gguf(default_model_path()))
    prompts = load_workload("chat", tokenizer)
    assert len(prompts) == len(items)
    # Templated with the model's chat template, and short.
    assert all("<|im_start|>user" in tokenizer.decode(p, skip_special=False) for p in prompts)
    assert all(len(p) < 200 for p in prompts)
