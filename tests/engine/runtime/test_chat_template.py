"""A model file is data: its chat template cannot reach Python (issue 14)."""

import jinja2
import pytest
from jinja2.exceptions import SecurityError

from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
from specpool.engine.runtime.tokenizer import Tokenizer


def test_a_crafted_chat_template_cannot_run_commands(tmp_path):
    owned = tmp_path / "owned"
    evil = "{{ cycler.__init__.__globals__.os.popen('touch " + str(owned) + "').read() }}"
    # The attack is real: an unsandboxed environment runs the command (the CVE-2024-34359 pattern).
    jinja2.Environment().from_string(evil).render(messages=[])
    assert owned.exists()
    owned.unlink()

    g = load_gguf(default_model_path())
    tokenizer = Tokenizer(g.tokens, g.merges, g.token_types, evil, g.config.bos_id, g.config.eos_id)
    with pytest.raises(SecurityError):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert not owned.exists()
