"""The speculation vocabulary both ends share: every method survives both wire enums, unknown numbers
and bad sampling values are refused naming their field, and q's travel rule is the one both ends apply."""

import math

import pytest

from specpool.common.errors import FieldError
from specpool.common.speculation import (
    SPARSE_Q_MAX_K,
    drafter_from_pb,
    drafter_to_pb,
    method_from_pb,
    method_to_pb,
    q_travels_dense,
    sampling_from_pb,
    sampling_to_pb,
    sparse_q_from_pb,
    sparse_q_to_pb,
)
from specpool.engine.method import Method
from specpool.engine.verification.sampling import SamplingParams
from specpool_client.v1 import speculation_pb2 as spec_pb
from specpool_client.v1 import target_pb2


def test_every_method_round_trips_through_the_target_api_enum():
    assert method_from_pb(target_pb2.SPECULATION_METHOD_UNSPECIFIED) is None
    assert method_to_pb(None) == target_pb2.SPECULATION_METHOD_UNSPECIFIED
    for method in Method:
        assert method_from_pb(method_to_pb(method)) is method
    # Every number the proto declares maps somewhere: a new enum value cannot be forgotten here.
    assert {method_to_pb(m) for m in [None, *Method]} == set(target_pb2.SpeculationMethod.values())


def test_every_drafter_round_trips_and_none_is_not_a_drafter():
    assert drafter_from_pb(spec_pb.DRAFTER_KIND_UNSPECIFIED) is None
    drafters = [m for m in Method if m is not Method.NONE]
    for method in drafters:
        assert drafter_from_pb(drafter_to_pb(method)) is method
    assert {drafter_to_pb(m) for m in [None, *drafters]} == set(spec_pb.DrafterKind.values())
    with pytest.raises(ValueError, match="not a drafter"):
        drafter_to_pb(Method.NONE)


@pytest.mark.parametrize("convert, field", [(method_from_pb, "speculation.method"),
                                            (drafter_from_pb, "drafter")])
def test_unknown_enum_numbers_name_the_field(convert, field):
    with pytest.raises(FieldError) as err:
        convert(99)
    assert err.value.field == field and "99" in err.value.message


def test_sampling_round_trips_with_and_without_a_seed():
    # The wire carries float32: these values are exact in it.
    for params in (SamplingParams(), SamplingParams(temperature=0.75, top_k=40, top_p=0.875, min_p=0.125, seed=123)):
        assert sampling_from_pb(sampling_to_pb(params)) == params
    assert not sampling_to_pb(SamplingParams()).HasField("seed")
    # top_p 0 on the wire is proto3's "unset": no nucleus truncation.
    assert sampling_from_pb(target_pb2.SamplingParams(temperature=1.0, top_p=0.0)).top_p == 1.0


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
])
def test_bad_sampling_values_name_their_field(kwargs, field):
    with pytest.raises(FieldError) as err:
        sampling_from_pb(target_pb2.SamplingParams(**kwargs), "sessions[2].sampling")
    assert err.value.field == f"sessions[2].sampling.{field}"


def test_q_travels_dense_only_for_sampled_draft_model_drafts_with_a_wide_support():
    sampled = SamplingParams(temperature=0.8)
    assert q_travels_dense(sampled, Method.DRAFT_MODEL)
    assert not q_travels_dense(SamplingParams(), Method.DRAFT_MODEL)  # greedy: no q at all
    assert not q_travels_dense(sampled, Method.NGRAM)  # point masses
    assert not q_travels_dense(sampled, Method.SSD)  # SSD's q is always sparse
    narrow = SamplingParams(temperature=0.8, top_k=SPARSE_Q_MAX_K)
    assert not q_travels_dense(narrow, Method.DRAFT_MODEL)
    assert q_travels_dense(narrow, Method.DRAFT_MODEL, dense_asked=True)
    assert q_travels_dense(SamplingParams(temperature=0.8, top_k=SPARSE_Q_MAX_K + 1), Method.DRAFT_MODEL)


def test_sparse_q_round_trips_and_refuses_sizes_that_disagree():
    ids, probs = [1, 2, 3, 4, 5, 6], [0.5, 0.25, 0.25, 0.6, 0.3, 0.1]
    decoded = sparse_q_from_pb(sparse_q_to_pb(ids, probs, k=3), rows=2)
    assert decoded is not None
    assert decoded[0].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert decoded[1].shape == (2, 3)
    assert sparse_q_from_pb(sparse_q_to_pb(ids, probs, k=3), rows=3) is None  # 2 rows sent, 3 drafts
    assert sparse_q_from_pb(sparse_q_to_pb(ids, probs[:-1], k=3), rows=2) is None
    assert sparse_q_from_pb(sparse_q_to_pb([], [], k=0), rows=0) is None
