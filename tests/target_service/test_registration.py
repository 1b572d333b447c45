"""What a target's heartbeat tells routers about SSD: its policy's own estimate (the one its rounds are
chosen by), discounted to plain decoding on all the cores of its layout (serve-target --layout-cores)."""

from __future__ import annotations

import json
import time
from itertools import cycle
from types import SimpleNamespace

import pytest
import torch

from specpool.common.registry_schema import (
    EndpointRegistration,
    TargetRegistration,
    decode_record,
    encode_fields,
)
from specpool.engine.decoding import Decoder
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.method import METHODS, Method
from specpool.engine.plan import NO_SPECULATION, SpeculationPlan
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts, cached_step_costs
from specpool.engine.policy.draft_length import Running
from specpool.router.decisions import decide
from specpool.target_service.draft_length import TargetDraftLength
from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.registration import (
    HeartbeatFields,
    Layout,
    ar_on_layout_ratio,
    predicted_speedup,
    refresh_without_registry,
)
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool_client.v1 import speculation_pb2 as pb

# The target's own step costs: T(b, s) = 10 ms + 0.1 ms * b * (s + 1), memory-bound at small batches.
BATCHES, LENS = (1, 2, 4, 8, 16), (0, 1, 2, 4, 8)
OWN = StepCosts(BATCHES, LENS, tuple(tuple(0.010 + 0.0001 * b * (s + 1) for s in LENS) for b in BATCHES))
ACCEPTANCE = AcceptanceEstimate(prior_alpha=0.8, prior_weight=1e9)  # fixed at alpha 0.8


class Recorder:
    def attached(self, capacity):
        pass


@pytest.fixture
def draft_length():
    """A target's draft length over a real remote drafter (no endpoint process: its draft costs as an
    attached endpoint would have told them), the draft model a quarter of a target step."""
    drafter = RemoteDrafter("t1", "tiny", 64, None, NgramDrafter(), Recorder())
    drafter.capacity = pb.GetCapacityResponse(models=[pb.ModelDrafters(target_model="tiny", draft_step_costs=pb.StepCostTable(
        batch_sizes=[1, 16], draft_lens=[0, 8], seconds=[0.0025, 0.003, 0.004, 0.006]))])
    return TargetDraftLength(drafter, OWN)


def heartbeat(draft_length: TargetDraftLength, layout: Layout | None = None, acceptance_of=None) -> dict:
    metrics = TargetMetrics("tiny", "t1")
    extra = {"layout": layout} if layout is not None else {}
    fields = HeartbeatFields(
        "h:1", "tiny", "t1", 16, scheduler=SimpleNamespace(load=lambda: (0, 0)),
        decoder=SimpleNamespace(acceptance_of=acceptance_of or (lambda method: ACCEPTANCE)), metrics=metrics,
        drafter=draft_length.drafter,
        free_policy=draft_length.free, draft_policy_fn=lambda: draft_length.draft_model,
        ssd_policy_fn=draft_length.ssd_policy, **extra).fields()
    assert metrics.registry.get_sample_value(
        "specpool_target_predicted_speedup", {"model": "tiny", "tenant": "t1", "method": "ssd"}
    ) == fields["predicted_speedup_ssd"]
    return fields


def test_the_heartbeat_tells_the_estimate_ssds_rounds_are_chosen_by(draft_length):
    """SSD's figure is its own policy's (misses pay the draft model, hits nothing), not the draft
    model's: it rises with the hit ratio, and the lengths SSD's rounds get follow the same policy."""
    drafter = draft_length.drafter
    figures = {}
    for hits in (0.0, 1.0):
        drafter.ssd_hit_ratio.value = hits
        fields = heartbeat(draft_length)
        figures[hits] = fields["predicted_speedup_ssd"]
        assert figures[hits] == round(predicted_speedup(draft_length.ssd_policy(), 1, ACCEPTANCE), 4)
        ssd_round = draft_length.lengths([Running("s", 0, 100, SpeculationPlan(Method.SSD, True))], ACCEPTANCE)
        assert ssd_round == [draft_length.ssd_policy().choose(1, ACCEPTANCE.expected_tokens, remaining=100)]
    assert figures[0.0] == fields["predicted_speedup_draft"]  # all misses: a draft model's
    assert figures[1.0] > fields["predicted_speedup_draft"] + 0.3  # all hits: drafting off the critical path
    assert figures[1.0] > 1.0 and draft_length.ssd_policy().round_s == 0.0


def test_each_method_is_predicted_from_the_acceptance_its_own_sequences_measured(draft_length):
    """The draft model drafting for its 1.5B sibling accepts far more than an n-gram index: pooled into one
    estimate, the n-gram (free to draft) always looked faster, and routers never planned the draft model."""
    measured = {Method.DRAFT_MODEL: AcceptanceEstimate(prior_alpha=0.95, prior_weight=1e9),
                Method.NGRAM: AcceptanceEstimate(prior_alpha=0.2, prior_weight=1e9)}
    fields = heartbeat(draft_length, acceptance_of=lambda method: measured.get(method, ACCEPTANCE))
    assert fields["predicted_speedup_draft"] == round(
        predicted_speedup(draft_length.draft_model, 1, measured[Method.DRAFT_MODEL]), 4)
    assert fields["predicted_speedup_ngram"] == round(predicted_speedup(draft_length.free, 1, measured[Method.NGRAM]), 4)
    assert fields["predicted_speedup_draft"] > fields["predicted_speedup_ngram"] + 0.5
    assert fields["predicted_speedup_ssd"] == round(predicted_speedup(draft_length.ssd_policy(), 1, ACCEPTANCE), 4)


def test_the_heartbeat_predicts_each_method_at_every_batch_size_a_request_may_join(draft_length):
    """Routers plan a burst of requests, all placed within one heartbeat, by the batch each one joins: the beat
    carries each method's figure at batch 1 to max_batch (16 here), the same estimate as the one at running + 1."""
    fields = heartbeat(draft_length)
    for row in METHODS:
        if row.speedup_field is None:
            continue
        by_batch = fields[f"{row.speedup_field}_by_batch"]
        assert len(by_batch) == 16 and by_batch[0] == fields[row.speedup_field]
    draft = fields["predicted_speedup_draft_by_batch"]
    assert draft[3] == round(predicted_speedup(draft_length.draft_model, 4, ACCEPTANCE), 4)
    assert draft[0] > draft[15], "verifying drafts costs more at larger batches (OWN's compute term)"


def test_a_layout_with_more_cores_than_the_targets_threads_discounts_ssd(draft_length, tiny_model, tmp_path):
    """One thread of two cores: without a table at two threads, plain decoding is assumed to run twice
    as fast on both (perfect scaling, the most it could gain); with one cached, its measured step."""
    draft_length.drafter.ssd_hit_ratio.value = 1.0
    own = heartbeat(draft_length)["predicted_speedup_ssd"]
    assert heartbeat(draft_length, Layout.of(tiny_model, "tiny", 1, None, tmp_path))["predicted_speedup_ssd"] == own

    scaled = Layout.of(tiny_model, "tiny", threads=1, cores=2, cache_dir=tmp_path)
    assert scaled.costs is None
    fields = heartbeat(draft_length, scaled)
    assert fields["predicted_speedup_ssd"] == pytest.approx(own / 2, abs=1e-4)
    assert fields["predicted_speedup_draft"] == heartbeat(draft_length)["predicted_speedup_draft"], "SSD's alone"

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as a run on both cores caches its table
    try:
        cached_step_costs(tiny_model, "tiny", tmp_path)
    finally:
        torch.set_num_threads(threads)
    [path] = tmp_path.iterdir()
    data = json.loads(path.read_text())  # measured on a shared machine: made a known 0.6 of our step
    path.write_text(json.dumps(data | {"seconds": [[0.6 * OWN(b, 0)] * len(data["draft_lens"])
                                                   for b in data["batch_sizes"]]}))
    measured = Layout.of(tiny_model, "tiny", threads=1, cores=2, cache_dir=tmp_path)
    assert measured.costs is not None
    assert heartbeat(draft_length, measured)["predicted_speedup_ssd"] == pytest.approx(own * 0.6, abs=1e-4)


def test_plain_decoding_on_the_layout_never_counts_slower_than_on_the_targets_threads():
    slower = StepCosts(BATCHES, LENS, tuple(tuple(2 * OWN(b, s) for s in LENS) for b in BATCHES))
    assert ar_on_layout_ratio(Layout(threads=1, cores=2, costs=slower), OWN, 4) == 1.0
    assert ar_on_layout_ratio(Layout(threads=2, cores=2), OWN, 4) == 1.0
    assert ar_on_layout_ratio(Layout(threads=1, cores=4), None, 4) == 0.25
    assert ar_on_layout_ratio(Layout(threads=1, cores=4, on_cpu=False), OWN, 4) == 1.0, "a drafter's GPU"


# The Qwen2.5-Coder pair's shape (2 cores, Intel Xeon): a 1.5B step 40 ms, a 5-row verify 48 ms; the 0.5B's step 9 ms.
QWEN = StepCosts((1, 2), (0, 4, 8, 16), ((0.040, 0.048, 0.055, 0.100), (0.042, 0.063, 0.103, 0.176)))


def test_requests_planned_to_plain_decoding_do_not_wipe_what_ngram_rounds_measured(tiny_model):
    """Issue 51, `make run` on the Qwen pair: the router planned n-gram again after its own requests had priced it
    under the draft model, because the AR requests between them (128 plain rounds each, through the same policy)
    faded n-gram's measured round overhead back to the table's: its figure rose from 1.28x to 1.58x, over the
    draft model's 1.45x. Rounds of requests planned to plain decoding are not rounds the policy declined to draft.
    Before n-gram's first round the heartbeat lists it unmeasured, and routers do not trust its prior."""
    drafter = RemoteDrafter("t1", "tiny", 64, None, NgramDrafter(), Recorder())
    drafter.capacity = pb.GetCapacityResponse(models=[pb.ModelDrafters(target_model="tiny", draft_step_costs=pb.StepCostTable(
        batch_sizes=[1, 2], draft_lens=[0, 8], seconds=[0.009, 0.011, 0.010, 0.013]))])
    draft_length = TargetDraftLength(drafter, QWEN)
    decoder = Decoder(tiny_model, 1, 64)  # holds each method's acceptance, as the target's does
    endpoint = EndpointRegistration(id="ep", address="h:9", models=("tiny",), max_sessions=8)

    def plan() -> tuple[Method, dict]:
        fields = heartbeat(draft_length, acceptance_of=decoder.acceptance_of)
        target = decode_record(TargetRegistration, encode_fields(fields | {"id": "h:1", "spec_endpoint": "h:9"}))
        speedups = {k: v for k, v in fields.items() if k.startswith("predicted_speedup")}
        return decide(None, target, endpoint, lambda e: True).method, speedups

    def request(method: Method, rounds: int, accepted: list[int], seconds, filled: list[bool] = (True,)):
        """One request's rounds through the target's policy: what each accepted, and what it took."""
        planned = NO_SPECULATION if method is Method.NONE else SpeculationPlan(method, True)
        acceptance = decoder.acceptance_of(None if method is Method.NONE else method)
        accepts, fills = cycle(accepted), cycle(filled)
        for i in range(rounds):
            [n] = draft_length.lengths([Running("s", 0, rounds - i, planned)], acceptance)
            n = 0 if method is Method.NONE else n  # the decoder offers a plan of none nothing
            k, drafted = min(next(accepts), n), n if next(fills) else 0
            if n:
                acceptance.update(k if drafted else 0, n, drafted)
            draft_length.observe(seconds(n))

    ar = (Method.NONE, 128, [0], lambda n: 0.040)  # plain rounds as the table times them
    # The router's probe of the draft model: ~3.8 tokens a round at 4 drafts, 1.45x as its rounds run.
    request(Method.DRAFT_MODEL, 40, [4, 3, 2, 4, 1], lambda n: 0.040 if n == 0 else 0.050 + 0.014 * n)
    request(*ar)
    method, untried = plan()
    assert untried["predicted_speedup_ngram"] > untried["predicted_speedup_draft"], "n-gram's prior, free drafts"
    assert method is Method.DRAFT_MODEL, untried  # the target lists n-gram unmeasured: its prior is not trusted
    # A request that asked for n-gram: half its offers filled, ~1.5 tokens a round, each drafting round 56 ms
    # (~1.1x AR).
    request(Method.NGRAM, 60, [1, 0, 2, 1], lambda n: 0.040 if n == 0 else 0.056, filled=[True, False])
    method, measured = plan()
    assert method is Method.DRAFT_MODEL, measured
    assert heartbeat(draft_length, acceptance_of=decoder.acceptance_of)["unmeasured"] == ["ssd"]
    assert measured["predicted_speedup_ngram"] < untried["predicted_speedup_ngram"] - 0.2
    for _ in range(2):  # the demo's next AUTO request follows two AR ones
        request(*ar)
    assert plan() == (Method.DRAFT_MODEL, measured), "AR requests tell nothing of n-gram's rounds"


def test_ssds_rounds_teach_ssds_figure_not_the_draft_models(draft_length):
    """SSD is charged the draft model's costs, but its rounds are its own: on the Qwen pair they ran 0.89x AR (its
    pre-speculation contending for the target's cores), and, learned into the draft model's slowdown, they priced
    the draft model from 1.48x down to 0.74x, under SSD's own figure, so routers kept planning SSD (issue 51)."""
    before = heartbeat(draft_length)
    ssd = [Running("s", 0, 100, SpeculationPlan(Method.SSD, True))]
    for _ in range(30):
        [n] = draft_length.lengths(ssd, ACCEPTANCE)
        draft_length.observe(3 * draft_length.ssd_policy().step_time(1, n))
    after = heartbeat(draft_length)
    assert after["predicted_speedup_draft"] == before["predicted_speedup_draft"]
    assert after["predicted_speedup_ssd"] < before["predicted_speedup_ssd"] - 0.3


def test_a_target_without_a_registry_still_refreshes_its_predicted_speedups(draft_length):
    """No Redis, no heartbeat: the fields are still read every interval, so /metrics' predicted speedups (what
    Grafana and `specpool bench` read) follow the policy; a read that raises is logged and the next one runs."""
    metrics = TargetMetrics("tiny", "t1")
    fields = HeartbeatFields(
        "h:1", "tiny", "t1", 16, scheduler=SimpleNamespace(load=lambda: (0, 0)),
        decoder=SimpleNamespace(acceptance_of=lambda method: ACCEPTANCE), metrics=metrics,
        drafter=draft_length.drafter, free_policy=draft_length.free, draft_policy_fn=lambda: draft_length.draft_model)
    reads = []

    def read() -> dict:
        reads.append(1)
        if len(reads) == 1:
            raise RuntimeError("the first read fails")
        return fields.fields()

    stop = refresh_without_registry(read, interval_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while len(reads) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
    assert len(reads) >= 3
    assert metrics.registry.get_sample_value(
        "specpool_target_predicted_speedup", {"model": "tiny", "tenant": "t1", "method": "draft_model"}) > 1.0
