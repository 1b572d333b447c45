"""Hugging Face model directories beyond the weights (issue 37): tokenizer.json and the chat template as
transformers renders them, the command line and serve-target on a directory, and bad files, each refused at
load naming the file and the field. The models are tests/engine/runtime/test_families.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specpool.engine.runtime.hf_config import ModelFileError
from specpool.engine.runtime.model import Llama
from tests.engine.runtime.test_families import hf_model, one_thread  # noqa: F401 (one_thread: an autouse fixture)

# -- a tokenizer, a chat template, the command line ----------------------------------------------------------

CHATML = ("{{ bos_token }}{% for m in messages %}\n"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}\n"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]  # ids 256..259


def save_byte_tokenizer(directory, chat_template: str = CHATML) -> None:
    """A byte-level tokenizer (the 256 bytes, no merges, four special tokens; a prompt starts with <|bos|>, as
    Llama's do) with a chat template, as transformers saves one: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 256)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": chat_template, "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A Qwen2-family model whose vocabulary is save_byte_tokenizer's (260 tokens, 4 spare rows)."""
    directory = tmp_path_factory.mktemp("chat")
    reference = hf_model("qwen2", vocab_size=264, bos_token_id=256, eos_token_id=257)
    reference.save_pretrained(directory)
    save_byte_tokenizer(directory)
    return reference, directory


def test_the_tokenizer_and_template_equal_transformers(chat_model):
    _, directory = chat_model
    _, tokenizer = Llama.from_path(directory, dtype="fp32", device="cpu")
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_start|> é 🙂"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n")  # bos_token, trimmed blocks
    assert tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)
    ids = tokenizer.encode_chat(messages)
    assert ids.count(258) == 3  # the turns' markers; the one a user typed is text
    assert ids.count(256) == 1  # the template's BOS, no other
    assert tokenizer.decode(ids, skip_special=False) == text
    assert tokenizer.encode_prompt("Hi there") == ref("Hi there").input_ids == [256, *tokenizer.encode("Hi there")]


def test_a_template_sees_the_special_tokens_tokenizer_config_names(tmp_path):
    """Qwen's tokenizer_config.json has no bos_token, whatever config.json's bos_token_id says."""
    hf_model("qwen2", vocab_size=264, bos_token_id=256, eos_token_id=257).save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path, "[{{ bos_token }}|{{ eos_token }}]{% for m in messages %}{{ m['content'] }}{% endfor %}")
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings | {"bos_token": None}))
    _, tokenizer = Llama.from_path(tmp_path, dtype="fp32", device="cpu")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False) == "[|<|eos|>]x"


def test_cli_generate_runs_a_hf_directory(chat_model):
    reference, directory = chat_model
    out = subprocess.run(
        [sys.executable, "-m", "specpool.cli", "generate", "--model", str(directory), "--chat", "--prompt", "Hello",
         "--max-tokens", "16", "--temperature", "0", "--json", "--dtype", "fp32", "--threads", "1"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    prompt = result["prompt_token_ids"]
    assert prompt[:2] == [256, 258]  # <|bos|><|im_start|>
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=257)
    assert result["token_ids"] == ref[0, len(prompt):].tolist()


def test_serve_target_serves_a_hf_directory(chat_model):
    """Under the directory's name, with its template, its end token and its BOS before a raw prompt."""
    from specpool.cluster.processes import start_server
    from specpool_client import generate_request, generate_result
    from specpool_client.v1 import target_pb2_grpc
    from tests.pki import channel

    reference, directory = chat_model
    _, tokenizer = Llama.from_path(directory, dtype="fp32", device="cpu")
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    raw = tokenizer.encode_prompt("Once upon a time")  # starts with <|bos|>
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=257)
        ref_raw = reference.generate(torch.tensor([raw]), max_new_tokens=12, do_sample=False, eos_token_id=257)
    target = start_server("target", ["serve-target", "--model", str(directory), "--port", "0", "--metrics-port", "0",
                                     "--threads", "1", "--datastore", "", "--draft-tokens", "2"])
    try:
        with channel(target.address, "target") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            result = generate_result(stub, generate_request(messages=[("user", "Hello")], max_tokens=12,
                                                            model=directory.name), timeout=60)
            raw_result = generate_result(stub, generate_request("Once upon a time", max_tokens=12), timeout=60)
    finally:
        target.stop()
    assert "Traceback" not in target.logs()
    assert result.model == directory.name
    assert list(result.completions[0].token_ids) == ref[0, len(prompt):].tolist()
    assert list(raw_result.completions[0].token_ids) == ref_raw[0, len(raw):].tolist()


def test_the_default_models_tokenizer_json_reads_as_its_gguf(tmp_path):
    """The SmolLM2 vocabulary as transformers saves it (tokenizer.json, chat_template.jinja) tokenizes and
    renders as the GGUF's own fields do."""
    from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf
    from specpool.engine.runtime.hf_loader import load_hf_tokenizer
    from specpool.engine.runtime.tokenizer import Tokenizer

    path = default_model_path()
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    gguf = load_gguf(path, only=set())
    ours, reference = load_hf_tokenizer(tmp_path, gguf.config), Tokenizer.from_gguf(gguf)
    messages = [{"role": "user", "content": "Write <|im_start|>a function: é 中文 🙂\n\tdef f(x):\n    return x**2"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)
    assert ours.encode_chat(messages) == reference.encode_chat(messages)
    text = messages[0]["content"]
    assert ours.encode_prompt(text) == reference.encode_prompt(text) == reference.encode(text)  # no BOS added
    assert (ours.vocab_size, ours.max_token_bytes, ours.control_tokens) == (
        reference.vocab_size, reference.max_token_bytes, reference.control_tokens)


def test_serve_spec_hosts_drafters_for_a_directory(tmp_path):
    """`--drafter DIR`: named as targets name it, the vocabulary and feature width read from its config."""
    from specpool.spec_endpoint.drafters import DrafterSpec, LoadOptions, ModelDrafters

    hf_model("qwen2").save_pretrained(tmp_path / "Qwen-tiny")
    spec = DrafterSpec.parse(str(tmp_path / "Qwen-tiny"))
    drafters = ModelDrafters.load(spec, LoadOptions(max_sessions=2, max_len=128, device=torch.device("cpu")))
    assert (drafters.name, drafters.vocab_size, drafters.feature_dim) == ("Qwen-tiny", 256, 64)
    assert [kind.value for kind in drafters.kinds] == ["ngram"]


# -- bad model files: each fails at load, naming the file and the field --------------------------------------


def _load_error(directory) -> ModelFileError:
    with pytest.raises(ModelFileError) as err:
        Llama.from_path(directory, dtype="fp32", device="cpu")
    assert str(err.value.path) in str(err.value) and err.value.field in str(err.value)
    return err.value


@pytest.fixture
def saved(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_a_truncated_shard(saved):
    shard = saved / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    err = _load_error(saved)
    assert (err.path, err.field) == (shard, "safetensors header")


def test_a_missing_tensor(saved):
    shard = saved / "model.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    err = _load_error(saved)
    assert (err.path, err.field) == (shard, "model.layers.1.mlp.up_proj.weight")


def test_a_missing_shard(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    shard = max(tmp_path.glob("model-*.safetensors"))
    shard.unlink()
    err = _load_error(tmp_path)
    assert err.path == shard


def test_a_tensor_of_the_wrong_shape(saved):
    shard = saved / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(16)  # 2 kv heads x 16 = 32
    save_file(tensors, shard, metadata={"format": "pt"})
    err = _load_error(saved)
    assert (err.path, err.field) == (shard, "model.layers.0.self_attn.k_proj.bias")
    assert "(16,)" in str(err) and "(32,)" in str(err)


@pytest.mark.parametrize("key, value", [
    ("architectures", ["GPT2LMHeadModel"]),
    ("hidden_act", "gelu"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
    ("layer_types", ["full_attention", "sliding_attention"]),  # (Qwen's window on some layers only)
    ("num_hidden_layers", 3),  # the config of another checkpoint: a tensor is missing
])
def test_a_config_the_engine_cannot_run(saved, key, value):
    raw = json.loads((saved / "config.json").read_text())
    raw[key] = value
    raw["sliding_window"] = 8
    (saved / "config.json").write_text(json.dumps(raw))
    err = _load_error(saved)
    if key == "num_hidden_layers":
        assert (err.path.name, err.field) == ("model.safetensors", "model.layers.2.input_layernorm.weight")
    else:
        assert (err.path, err.field.split(".")[0]) == (saved / "config.json", key)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }}",  # unclosed: does not compile
    "{{ raise_exception('Conversation roles must alternate system/user/assistant') }}",
    "{{ messages[0]['content'].upper().nope() }}",  # calls what is undefined
    "{{ cycler.__init__.__globals__.os.popen('true').read() }}",  # the sandbox refuses it
])
def test_a_chat_template_that_fails_to_render(saved, template):
    reference = hf_model("qwen2", vocab_size=264)
    reference.save_pretrained(saved)
    save_byte_tokenizer(saved, template)
    err = _load_error(saved)
    assert (err.path, err.field) == (saved / "tokenizer_config.json", "chat_template")


def test_a_file_inside_the_directory(saved):
    err = _load_error(saved / "model.safetensors")
    assert (err.path, err.field) == (saved / "model.safetensors", "model.safetensors")
    assert "directory" in str(err)


def test_a_directory_without_config_json(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    err = _load_error(tmp_path)
    assert (err.path, err.field) == (tmp_path / "config.json", "config.json")
    assert "model.Q4_0.gguf" in str(err)


def test_an_index_that_names_a_file_outside_the_directory(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(raw))
    err = _load_error(tmp_path)
    assert (err.path, err.field) == (index, "weight_map.model.norm.weight")
