"""The model families operators run, from Hugging Face directories (issue 37): for each family a tiny random
model built by transformers from that family's config class, saved with save_pretrained, loaded by the
engine and checked against transformers itself: logits, greedy ids, and speculation equal to AR."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

from specpool.engine.decoding import generate
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama
from specpool.engine.verification import token_tree
from specpool.engine.verification.sampling import SamplingParams

SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "bos_token_id": 1, "eos_token_id": 2}
# Each family with the feature that sets it apart, sized so that it matters within a test's 100 positions.
FAMILIES = {
    # Llama 3.1: llama3 RoPE scaling (waves longer than 32 / 1 positions slowed 8x, 32 / 4 to 32 blended).
    "llama3": (transformers.LlamaConfig, {"rope_scaling": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),  # Llama 3.2 1B/3B tie theirs
    "mistral": (transformers.MistralConfig, {"sliding_window": 12}),  # a query sees its last 12 positions
    "qwen2": (transformers.Qwen2Config, {"rope_theta": 1000000.0}),  # q/k/v biases
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),  # q/k norms; 4 heads x 32 != 64
}
MODEL_CLASSES = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
                 transformers.MistralConfig: transformers.MistralForCausalLM,
                 transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
                 transformers.Qwen3Config: transformers.Qwen3ForCausalLM}
PROMPTS = [[1, 17, 200, 35, 99, 4, 150, 61, 77, 8, 230, 12, 45, 190, 3, 66, 123, 9, 250, 31],
           [1, 88, 5, 140, 27, 211]]
NEW_TOKENS = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and beside a busy process OpenMP's spinning workers
    made these tests 60x slower (0.5 -> 34 s a speculation test on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny random model of the family, weights scaled up so its logits are far from ties (transformers'
    own init, std 0.02, makes every logit nearly equal)."""
    config_class, features = FAMILIES[family]
    config = config_class(**(SHAPE | features | overrides))
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config_class](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.2))
    model.generation_config.eos_token_id = None  # ids past eos compare too
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, the transformers model, its saved directory, the engine's fp32 model of that directory)."""
    reference = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    model, tokenizer = Llama.from_path(directory, dtype="fp32", device="cpu")
    assert tokenizer is None  # no tokenizer.json: fed ids
    return request.param, reference, directory, model


def _all_logits(model: Llama, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    return model.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]  # [T, V]


def _hf_greedy(reference, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, num_beams=1)
    return out[0, len(prompt):].tolist()


def test_the_family_feature_is_on(family):
    name, _, _, model = family
    cfg = model.config
    assert {"llama3": cfg.rope_scaling is not None, "llama-tied": cfg.tie_embeddings,
            "mistral": cfg.windowed and cfg.sliding_window == 12, "qwen2": cfg.qkv_bias,
            "qwen3": cfg.qk_norm and cfg.head_dim == 32}[name]
    assert not model.fused


def test_logits_match_transformers(family):
    _, reference, _, model = family
    tokens = PROMPTS[0] * 5  # 100 positions: past the window, the original context, many RoPE periods
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0]
    diff = (_all_logits(model, tokens) - ref).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.2e}"


def test_greedy_ids_equal_transformers_generate(family):
    _, reference, _, model = family
    batched = generate(model, PROMPTS, SamplingParams(), NEW_TOKENS, stop_ids=[])  # a ragged batch of two
    for prompt, result in zip(PROMPTS, batched):
        assert result.token_ids == _hf_greedy(reference, prompt)


def test_speculation_with_a_draft_of_the_family_equals_ar(family, tmp_path):
    """The draft: the target's first layer alone (a model of the family that often agrees with it)."""
    name, reference, _, model = family
    draft_hf = hf_model(name, num_hidden_layers=1)
    draft_hf.load_state_dict(reference.state_dict(), strict=False)
    draft_hf.save_pretrained(tmp_path)
    draft, _ = Llama.from_path(tmp_path, dtype="fp32", device="cpu")
    params = SamplingParams()
    ar = generate(model, PROMPTS, params, NEW_TOKENS, stop_ids=[])
    spec = generate(model, PROMPTS, params, NEW_TOKENS, ModelDrafter(draft, 2, 256), num_draft_tokens=4, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert all(r.drafted_tokens > 0 for r in spec)
    assert sum(r.accepted_tokens for r in spec) > 0
    # Token trees: each node sees its ancestors only, at its depth's position (and, in Mistral, its window).
    tree = ModelDrafter(draft, 2, 256, tree=TreeShape(branch=2, beam=2, max_depth=4))
    trees = generate(model, PROMPTS, params, NEW_TOKENS, tree, num_draft_tokens=6, stop_ids=[])
    assert [r.token_ids for r in trees] == [r.token_ids for r in ar]
    assert all(r.drafted_tokens > 0 for r in trees)


def test_sharded_checkpoints_and_transformers_4_configs_load_alike(tmp_path):
    """An index over several shards; a config.json as transformers 4 wrote it (rope_theta and rope_scaling
    with "type", not rope_parameters), as most checkpoints on the Hub are."""
    reference = hf_model("llama3")
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type": rope.pop("rope_type")} | rope
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, _ = Llama.from_path(tmp_path, dtype="fp32", device="cpu")
    assert model.config.rope_scaling is not None and model.config.rope_base == 500000.0
    tokens = PROMPTS[0] * 3
    with torch.no_grad():
        ref = reference(torch.tensor([tokens])).logits[0]
    assert (_all_logits(model, tokens) - ref).abs().max().item() < 1e-4


def test_a_window_as_long_as_the_context_keeps_no_mask(tmp_path):
    """Mistral v0.2+ checkpoints set no window; one that covers the whole context is the same model."""
    hf_model("mistral", sliding_window=256).save_pretrained(tmp_path)
    model, _ = Llama.from_path(tmp_path, dtype="fp32", device="cpu")
    assert not model.config.windowed


def test_a_windowed_tree_gives_every_node_its_paths_logits():
    """A node sits at its depth's position, wherever it was fed: with a window of 2, the deepest node of a wide
    tree no longer sees its grandparent, fed fifth but at depth 1. With biases and q/k norms too."""
    from tests.engine.verification.test_token_tree import PROMPT, ROOT, _fed_parents, _path_logits

    tokens, parents = [11, 12, 13, 14, 15, 16], [-1, -1, -1, -1, 3, 4]  # root -> a, b, c, d; d -> e -> f
    model = Llama.random_init(replace(tiny_config(vocab_size=64), sliding_window=2, qkv_bias=True, qk_norm=True),
                              seed=3)
    cache = model.new_cache(2, 64)
    slots = [cache.allocate(), cache.allocate()]
    model.forward(cache, slots, [PROMPT, PROMPT[:3]])
    feeds, fed = [[ROOT, *tokens], [4, 8, 2]], [_fed_parents(parents), token_tree.chain(3)]
    logits = model.forward(cache, slots, feeds, all_logits=True, parents=fed)
    for node in range(len(tokens)):
        path = [tokens[i] for i in token_tree.path_to(parents, node)]
        torch.testing.assert_close(logits[0, node + 1], _path_logits(model, path), atol=1e-4, rtol=1e-4)


def test_every_end_token_the_model_declares_stops_a_sequence(tmp_path):
    """Llama 3.1 lists three end tokens (<|end_of_text|>, <|eom_id|>, <|eot_id|>): a chat ends at the third."""
    free = hf_model("llama3")
    stop = _hf_greedy(free, PROMPTS[1])[5]
    reference = hf_model("llama3", eos_token_id=[2, stop])
    reference.save_pretrained(tmp_path)
    model, _ = Llama.from_path(tmp_path, dtype="fp32", device="cpu")
    assert model.config.stop_ids == (2, stop)
    [result] = generate(model, [PROMPTS[1]], SamplingParams(), NEW_TOKENS)
    assert result.finish_reason == "stop" and result.token_ids[-1] == stop
    assert len(result.token_ids) <= 6


def test_a_drafter_reads_the_targets_embeddings_from_a_directory(family):
    """serve-spec's `--drafter NAME=DIR`: a draft reads the target's input embeddings, only those."""
    from specpool.engine.runtime.gguf_loader import model_name
    from specpool.engine.runtime.hf_loader import load_model_file

    _, reference, directory, model = family
    target = load_model_file(directory, only={"embed"})
    assert set(target.weights) == {"embed"} and target.config == model.config
    assert torch.equal(target.weights["embed"], reference.model.embed_tokens.weight.detach())
    assert model_name(directory) == directory.name
    assert model_name("/cache/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557604adf") == "Qwen2.5-0.5B-Instruct"
