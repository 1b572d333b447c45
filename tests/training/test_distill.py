"""The trainable draft computes what the runtime computes, and its export loads unchanged."""

import torch

from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama
from specpool.training.distill import DraftLM, distill_loss, export


def _tiny_target_weights(seed=0):
    config = tiny_config(vocab_size=64, n_layers=3)
    gen = torch.Generator().manual_seed(seed)
    d, hd = config.d_model, config.head_dim
    weights = {"embed": torch.randn(config.vocab_size, d, generator=gen), "norm": torch.ones(d)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes = {
            "wq": (config.n_heads * hd, d), "wk": (config.n_kv_heads * hd, d), "wv": (config.n_kv_heads * hd, d),
            "wo": (d, config.n_heads * hd), "w_gate": (config.ffn_dim, d), "w_up": (config.ffn_dim, d),
            "w_down": (d, config.ffn_dim),
        }
        weights |= {p + n: torch.randn(*s, generator=gen) * 0.2 for n, s in shapes.items()}
        weights |= {p + "attn_norm": 1 + 0.1 * torch.randn(d, generator=gen), p + "ffn_norm": torch.ones(d)}
    return config, weights


def test_export_loads_into_runtime_with_same_logits(tmp_path):
    config, weights = _tiny_target_weights()
    output_ids = torch.tensor([2, 5, 7, 11, 13, 17, 19, 23, 29, 31, 40, 63])
    draft = DraftLM.from_target(config, weights, [0, 2], output_ids)
    export(draft, tmp_path, "tiny.gguf", dtype=torch.float32)
    runtime = Llama.from_draft_checkpoint(tmp_path, weights["embed"], dtype="fp32", device="cpu")

    tokens = [3, 9, 27, 17, 51, 4, 8]
    with torch.no_grad():
        reduced = draft(torch.tensor([tokens]))[0]  # [T, Vd]
    cache = runtime.new_cache(1, 16)
    full = runtime.forward(cache, [cache.allocate()], [tokens], all_logits=True)[0]  # [T, V]
    torch.testing.assert_close(full[:, output_ids], reduced, atol=1e-4, rtol=1e-4)
    outside = torch.ones(64, dtype=torch.bool)
    outside[output_ids] = False
    assert torch.isinf(full[:, outside]).all()  # tokens outside the draft vocabulary are never proposed


def test_distillation_lowers_the_loss():
    config, weights = _tiny_target_weights()
    output_ids = torch.arange(64)
    draft = DraftLM.from_target(config, weights, [0], output_ids)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    teacher = torch.softmax(torch.randn(4, 12, 64, generator=torch.Generator().manual_seed(2)) * 3, -1)
    top = teacher.topk(8, dim=-1)
    probs = top.values / top.values.sum(-1, keepdim=True)
    mask = torch.ones(4, 12, dtype=torch.bool)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss, _ = distill_loss(draft(tokens), top.indices, probs, mask)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
