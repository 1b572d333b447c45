"""The forward over the slot-indexed cache: ragged batches, joins/leaves, cheap rollback."""

import torch

from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.device import native_bf16
from specpool.engine.runtime.model import Llama


def _prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(length),), generator=gen).tolist() for length in range(3, 3 + 2 * n, 2)]


def test_incremental_decode_matches_full_forward(tiny_model):
    tokens = _prompts(1, 64)[0] + [5, 9, 11, 13]
    full_cache = tiny_model.new_cache(1, 64)
    full = tiny_model.forward(full_cache, [full_cache.allocate()], [tokens], all_logits=True)[0]  # [T, V]

    cache = tiny_model.new_cache(1, 64)
    slot = cache.allocate()
    steps = [tiny_model.forward(cache, [slot], [tokens[:3]])]
    for t in tokens[3:]:
        steps.append(tiny_model.forward(cache, [slot], [[t]]))
    torch.testing.assert_close(torch.cat(steps), full[2:], atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_each_sequence_alone(tiny_model):
    prompts = _prompts(5, 64)
    cache = tiny_model.new_cache(8, 64)
    # Non-contiguous slots: the gather path, not only the contiguous view.
    for _ in range(3):
        cache.allocate()
    slots = [cache.allocate() for _ in prompts][::-1]
    batched = tiny_model.forward(cache, slots, prompts)
    stepped = tiny_model.forward(cache, slots, [[7], [8, 9], [10], [11, 12, 13], [14]], all_logits=True)
    for b, prompt in enumerate(prompts):
        alone = tiny_model.new_cache(1, 64)
        s = alone.allocate()
        torch.testing.assert_close(tiny_model.forward(alone, [s], [prompt])[0], batched[b], atol=1e-5, rtol=1e-5)
        row = [[7], [8, 9], [10], [11, 12, 13], [14]][b]
        want = tiny_model.forward(alone, [s], [row], all_logits=True)[0]
        # Batched short steps use grouped bmm attention, a lone row uses SDPA: fp32 rounding differs.
        torch.testing.assert_close(stepped[b, : len(row)], want, atol=1e-4, rtol=1e-4)


def test_a_short_row_at_the_end_of_the_context_beside_a_longer_one():
    """Found fuzzing the endpoint: a 1-token row at the last position, batched with a 3-token row, padded
    past the rope table (IndexError for the whole batch)."""
    from dataclasses import replace

    config = replace(tiny_config(vocab_size=64), max_context=16)
    model = Llama.random_init(config, seed=2)
    cache = model.new_cache(2, 16)
    long, short = cache.allocate(), cache.allocate()
    prompt = _prompts(1, 64)[0]
    model.forward(cache, [long, short], [prompt, list(range(3, 18))])
    both = model.forward(cache, [long, short], [[7, 8, 9], [20]], all_logits=True)
    alone = model.new_cache(1, 16)
    slot = alone.allocate()
    model.forward(alone, [slot], [list(range(3, 18))])
    torch.testing.assert_close(both[1, 0], model.forward(alone, [slot], [[20]])[0], atol=1e-5, rtol=1e-5)


def test_rollback_forgets_rejected_positions(tiny_model):
    prompt = _prompts(1, 64)[0]
    cache = tiny_model.new_cache(2, 64)
    a, b = cache.allocate(), cache.allocate()
    tiny_model.forward(cache, [a, b], [prompt, prompt])
    tiny_model.forward(cache, [a], [[40, 41, 42]], all_logits=True)  # a verify step whose drafts are all rejected
    cache.truncate(a, len(prompt))
    after_rollback = tiny_model.forward(cache, [a], [[5, 6]], all_logits=True)
    clean = tiny_model.forward(cache, [b], [[5, 6]], all_logits=True)
    torch.testing.assert_close(after_rollback, clean, atol=1e-6, rtol=1e-6)


def test_sequences_join_and_leave_between_steps(tiny_model):
    prompts = _prompts(3, 64)
    cache = tiny_model.new_cache(2, 64)
    first = cache.allocate()
    tiny_model.forward(cache, [first], [prompts[0]])
    second = cache.allocate()  # joins while `first` is mid-decode: a prefill and a decode in one step
    mixed = tiny_model.forward(cache, [first, second], [[9], prompts[1]])
    cache.release(first)  # leaves; its slot is reused by a newcomer
    third = cache.allocate()
    assert third == first
    tiny_model.forward(cache, [third], [prompts[2]])

    ref = tiny_model.new_cache(1, 64)
    s = ref.allocate()
    tiny_model.forward(ref, [s], [prompts[0]])
    torch.testing.assert_close(tiny_model.forward(ref, [s], [[9]])[0], mixed[0], atol=1e-5, rtol=1e-5)
    ref.release(s)
    s = ref.allocate()
    torch.testing.assert_close(tiny_model.forward(ref, [s], [prompts[1]])[0], mixed[1], atol=1e-5, rtol=1e-5)


def test_bf16_request_runs_natively_or_falls_back_to_fp32(cpu_kind):
    """bf16 where the CPU has it (close to fp32); elsewhere the same request loads fp32 weights."""
    config = tiny_config(vocab_size=64)
    fp32 = Llama.random_init(config, seed=3)
    asked_bf16 = Llama.random_init(config, seed=3, dtype=torch.bfloat16)
    native = cpu_kind == "native" and native_bf16("cpu")
    assert asked_bf16.dtype == (torch.bfloat16 if native else torch.float32)
    prompt = _prompts(1, 64)[0]
    outs = []
    for m in (fp32, asked_bf16):
        cache = m.new_cache(1, 32)
        outs.append(m.forward(cache, [cache.allocate()], [prompt]))
    assert outs[1].dtype == torch.float32
    if native:
        assert (outs[0] - outs[1]).abs().max() < 0.15 * outs[0].abs().max()
    else:
        assert torch.equal(outs[0], outs[1])
