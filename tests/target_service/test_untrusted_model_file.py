"""A model file is data (issue 14): a GGUF whose chat template reaches for Python runs nothing inside
serve-target; the chat request gets FAILED_PRECONDITION, and raw prompts still work."""

from dataclasses import replace

import grpc
import pytest

from specpool.cluster.processes import start_server
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf, save_gguf
from specpool.engine.runtime.model import random_weights
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc
from tests.pki import channel


def test_a_crafted_chat_template_runs_nothing_in_serve_target(tmp_path):
    real = load_gguf(default_model_path())
    config = replace(tiny_config(vocab_size=real.config.vocab_size, d_model=16),
                     bos_id=real.config.bos_id, eos_id=real.config.eos_id)
    owned = tmp_path / "owned"
    evil = "{{ cycler.__init__.__globals__.os.popen('touch " + str(owned) + "').read() }}"
    gguf = save_gguf(tmp_path / "crafted.gguf", config, random_weights(config, seed=1), tokenizer_of=real,
                     chat_template=evil)
    target = start_server("target", ["serve-target", "--model", str(gguf), "--port", "0", "--metrics-port", "0",
                                     "--threads", "1", "--datastore", ""])
    try:
        with channel(target.address, "target") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            chat = pb.GenerateRequest(max_tokens=2, messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="hi")]))
            with pytest.raises(grpc.RpcError) as err:
                generate_result(stub, chat, timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details().startswith("messages: this model's chat template failed (SecurityError")
            assert not owned.exists()
            assert len(generate_result(stub, pb.GenerateRequest(prompt="hi", max_tokens=2, ignore_eos=True),
                                          timeout=30).completions[0].token_ids) == 2
    finally:
        target.stop()
    assert "Traceback" not in target.logs()
