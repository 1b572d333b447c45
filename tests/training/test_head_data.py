"""The head's data pass: features recorded from the decoding forwards are the target's at every
position, answers equal plain decoding, and a rerun answers only what no shard holds."""

import torch

from specpool.engine.decoding import generate
from specpool.engine.verification.sampling import SamplingParams
from specpool.training.head_data import answer_params, record_features

PROMPTS = [torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7, 2, 11, 5, 9)]


def test_recorded_features_are_the_targets_at_every_position_and_answers_equal_decoding(tiny_model, tmp_path):
    corpus = record_features(tiny_model, PROMPTS, tmp_path, seconds=600, batch_size=4, max_new_tokens=12)
    by_prompt = {tuple(s[:n]): (s, f) for s, n, f in zip(corpus.sequences, corpus.prompt_lens, corpus.features)}
    assert len(by_prompt) == len(PROMPTS), "every prompt answered once"
    for i, prompt in enumerate(PROMPTS):
        sequence, features = by_prompt[tuple(prompt)]
        assert len(features) == len(sequence) > len(prompt)
        if answer_params(i, 0) == SamplingParams():  # greedy: what plain decoding emits (one short: see docs)
            ar = generate(tiny_model, [prompt], SamplingParams(), 12)[0].token_ids
            assert sequence[len(prompt):] == ar[: len(sequence) - len(prompt)]
        cache = tiny_model.new_cache(1, len(sequence))
        _, forced = tiny_model.forward(cache, [cache.allocate()], [sequence], features=True)
        torch.testing.assert_close(features.float(), forced[0].float(), atol=2e-3, rtol=2e-3)


def test_a_rerun_answers_only_the_prompts_no_shard_holds(tiny_model, tmp_path):
    record_features(tiny_model, PROMPTS, tmp_path, seconds=600, batch_size=4, max_new_tokens=12, shard_tokens=1)
    shards = sorted(tmp_path.glob("shard-*.pt"))
    assert len(shards) == len(PROMPTS), "one sequence a shard at shard_tokens=1"
    lost = [torch.load(s)["prompt_ids"][0] for s in shards[1:3]]  # from the middle: new names must not clash
    for s in shards[1:3]:
        s.unlink()
    corpus = record_features(tiny_model, PROMPTS, tmp_path, seconds=600, batch_size=4, max_new_tokens=12,
                             shard_tokens=1)
    after = sorted(tmp_path.glob("shard-*.pt"))
    assert len(after) == len(PROMPTS) and after[:4] == [shards[0], *shards[3:]]
    redone = [torch.load(s)["prompt_ids"] for s in after[-2:]]
    assert sorted(i for ids in redone for i in ids) == sorted(lost)
    assert sorted(tuple(s[:n]) for s, n in zip(corpus.sequences, corpus.prompt_lens)) == sorted(map(tuple, PROMPTS))


def test_an_empty_time_budget_answers_nothing(tiny_model, tmp_path):
    assert record_features(tiny_model, PROMPTS, tmp_path, seconds=0).sequences == []
