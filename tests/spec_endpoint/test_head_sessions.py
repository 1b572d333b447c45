"""Head sessions on the endpoint: the target's features arrive on the tenant's tensor channel after each
round, the session's drafter starts with its first round's (the context's), and a round whose features
are missing, short or unreadable closes the sessions that read them, never another tenant's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpool.common.tensor_channel import LoopbackChannel
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.method import Method
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import load_gguf, save_gguf
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams
from specpool.spec_endpoint.drafters import DrafterSpec, HostedDrafters, LoadOptions
from specpool.spec_endpoint.endpoint import Endpoint, EndpointConfig
from specpool.spec_endpoint.messages import OpenRequest, Round, SequenceRound, SessionSpec
from specpool.training.head import HeadLM, export

V = 64
MODEL = "tiny"
GREEDY = SamplingParams()
CONTEXT = [5, 9, 11, 3, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """-> (target GGUF, head checkpoint dir, step-cost cache dir)."""
    root = tmp_path_factory.mktemp("head_sessions")
    cfg = tiny_config(vocab_size=V)
    weights = random_weights(cfg, seed=3)
    gguf = save_gguf(root / "tiny.gguf", cfg, weights)
    export(HeadLM.from_target(cfg, weights, torch.arange(V)), root / "head", "tiny.gguf", dtype=torch.float32)
    return gguf, root / "head", root / "step-costs"


def make_endpoint(files) -> Endpoint:
    gguf, head, costs = files
    drafters = HostedDrafters.load([DrafterSpec(MODEL, gguf, head_dir=head)],
                                   LoadOptions(max_sessions=4, max_len=128, device=torch.device("cpu"),
                                               step_cost_dir=costs, dtype="fp32"))
    return Endpoint(drafters, EndpointConfig(max_sessions=4, lease_s=30.0), clock=lambda: 0.0)


def features(n: int, seed: int = 0) -> torch.Tensor:
    d = tiny_config(vocab_size=V).d_model
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def open_head(endpoint, tenant="a", request_id="r", context=CONTEXT):
    spec = SessionSpec(request_id, tuple(context), GREEDY, drafter=Method.HEAD)
    [result] = endpoint.open_sessions(OpenRequest(tenant, MODEL, 0.0, (spec,)))
    return result


def one_round(endpoint, tenant, *sequences: SequenceRound, feature_dim: int | None = None, round_id: int = 1):
    stream = endpoint.open_stream()
    dim = tiny_config(vocab_size=V).d_model if feature_dim is None else feature_dim
    endpoint.submit(stream, Round(tenant, round_id, sequences, feature_dim=dim))
    assert endpoint.batcher.run_once()
    return stream.outbound.get_nowait().sequences


def test_a_head_session_starts_with_its_first_rounds_features_and_drafts_as_an_in_process_head(files):
    gguf, head_dir, _ = files
    endpoint = make_endpoint(files)
    opened = open_head(endpoint)
    assert opened.ok and opened.reads_features and opened.drafter is Method.HEAD
    head = Llama.from_draft_checkpoint(head_dir, load_gguf(gguf, only={"embed"}).weights["embed"], dtype="fp32",
                                       device="cpu")
    reference = HeadDrafter(head, 1, 128)

    # First round: the context's features (all but the last position's) and those of two new tokens.
    context_features, new = features(len(CONTEXT) - 1), [8, 21]
    new_features = features(len(new), seed=1)
    [got] = one_round(endpoint, "a", SequenceRound("r", tuple(new), 4, num_features=len(CONTEXT) + 1,
                                                   features=torch.cat([context_features, new_features])))
    reference.start("r", CONTEXT, features=context_features)
    reference.observe("r", new, features=new_features)
    assert not got.error
    assert got.tokens == reference.propose(["r"], [4], GREEDY, None).tokens[0]

    # Later rounds: one feature row per new token.
    new = [got.tokens[0], (got.tokens[1] + 1) % V]
    [again] = one_round(endpoint, "a", SequenceRound("r", tuple(new), 3, num_features=2, features=features(2, 2)),
                        round_id=2)
    reference.observe("r", new, features=features(2, 2))
    assert again.tokens == reference.propose(["r"], [3], GREEDY, None).tokens[0]


@pytest.mark.parametrize(("num_features", "feature_dim", "error"), [
    (0, None, "sequences[0].num_features: 0, expected 6"),
    (5, None, "sequences[0].num_features: 5, expected 6"),
    (6, 8, "feature_dim: 8, but this model's drafter reads features of"),
])
def test_a_round_with_the_wrong_features_closes_that_session(files, num_features, feature_dim, error):
    endpoint = make_endpoint(files)
    open_head(endpoint)
    dim = tiny_config(vocab_size=V).d_model if feature_dim is None else feature_dim
    rows = torch.zeros(num_features, dim, dtype=torch.float16)
    [got] = one_round(endpoint, "a", SequenceRound("r", (8, 21), 4, num_features=num_features, features=rows),
                      feature_dim=feature_dim)
    assert error in got.error and "session closed" in got.error
    assert not got.tokens and len(endpoint.sessions) == 0


def test_features_for_a_session_whose_drafter_reads_none_close_it(files):
    endpoint = make_endpoint(files)
    [opened] = endpoint.open_sessions(OpenRequest("a", MODEL, 0.0, (SessionSpec("n", (1, 2, 3), GREEDY,
                                                                                drafter=Method.NGRAM),)))
    assert opened.ok and not opened.reads_features
    [got] = one_round(endpoint, "a", SequenceRound("n", (4,), 2, num_features=1, features=features(1)))
    assert "sequences[0].num_features: 1, but this session's drafter reads none" in got.error


def test_features_arrive_on_the_tenants_channel_split_per_sequence(files):
    endpoint = make_endpoint(files)
    ours, theirs = LoopbackChannel.pair()
    endpoint.channels.attach("a", ours)
    sent = features(7)
    theirs.send(sent)
    d = sent.shape[1]
    got = endpoint.receive_features(Round("a", 1, (SequenceRound("x", (1,), 1, num_features=3),
                                                   SequenceRound("y", (), 1),
                                                   SequenceRound("z", (1,), 1, num_features=4)), feature_dim=d))
    assert not got.features_error
    assert torch.equal(got.sequences[0].features, sent[:3]) and torch.equal(got.sequences[2].features, sent[3:])
    assert got.sequences[1].features.shape == (0, d)


@pytest.mark.parametrize(("attach", "rows", "num_features", "feature_dim", "error"), [
    (False, None, 2, 16, "features need a tensor channel"),
    (True, None, -1, 16, "sequences[0].num_features: -1 is negative"),
    (True, None, 2, 0, "feature_dim: 0"),
    (True, None, 2, 33, "feature_dim: 33 is wider than any hosted model's features"),
    (True, None, 4 * 2048 + 1, 16, "num_features: 8193 rows, more than the 8192"),  # 4 sessions x 2048
    (True, torch.zeros(3, 16, dtype=torch.float16), 2, 16, "receiving them failed"),  # a wrong total
    (True, torch.full((2, 16), float("nan"), dtype=torch.float16), 2, 16, "non-finite"),
])
def test_features_that_cannot_be_read_fail_the_round_and_drop_the_channel(files, attach, rows, num_features,
                                                                           feature_dim, error):
    endpoint = make_endpoint(files)
    ours, theirs = LoopbackChannel.pair()
    if attach:
        endpoint.channels.attach("a", ours)
    if rows is not None:
        theirs.send(rows)
    got = endpoint.receive_features(Round("a", 1, (SequenceRound("x", (1, 2), 1, num_features=num_features),),
                                          feature_dim=feature_dim))
    assert error in got.features_error
    assert endpoint.channels.get("a") is None  # what is left on it is out of step: the target pairs anew


def test_a_tenants_unreadable_features_close_its_head_sessions_only(files):
    endpoint = make_endpoint(files)
    open_head(endpoint, "a")
    open_head(endpoint, "b")
    sa, sb = endpoint.open_stream(), endpoint.open_stream()
    d = tiny_config(vocab_size=V).d_model
    bad = Round("a", 1, (SequenceRound("r", (), 2, num_features=4),), feature_dim=d, features_error="features: lost")
    good = Round("b", 1, (SequenceRound("r", (), 2, num_features=4, features=features(4)),), feature_dim=d)
    endpoint.submit(sa, bad)
    endpoint.submit(sb, good)
    assert endpoint.batcher.run_once()
    [a] = sa.outbound.get_nowait().sequences
    [b] = sb.outbound.get_nowait().sequences
    assert "features: lost" in a.error and not a.tokens
    assert not b.error and len(b.tokens) == 2
