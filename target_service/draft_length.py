"""The target service's draft length, the one place it is decided: the hardware-aware policy for the
drafters now running (or a fixed length), then each request's own cap."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specpool.engine.method import LOCAL_METHOD, Method
from specpool.engine.plan import LOCAL_NGRAM
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts
from specpool.engine.policy.draft_length import (
    DraftLength,
    FixedDraftLength,
    Probe,
    Running,
    SpeculationPolicy,
)
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool_client.v1 import speculation_pb2 as pb


class TargetDraftLength:
    """engine.policy.draft_length.DraftLength over the remote drafter's sequences. With measured costs, the
    draft model is charged only while a running sequence drafts with it (n-gram drafting costs the
    target nothing measurable), SSD only for the share of rounds it misses, and every remote round its
    measured wire time: so no batch size speculates where that is predicted slower than plain
    decoding. Without costs, `fixed` tokens a round."""

    def __init__(self, drafter: RemoteDrafter, target_costs: StepCosts | None, fixed: int = 0):
        self.drafter = drafter
        self.free: SpeculationPolicy | None = None
        self.ssd: SpeculationPolicy | None = None
        self.fixed = FixedDraftLength(fixed)
        if target_costs is not None:
            self.free = SpeculationPolicy(target_costs, max_draft=LOCAL_METHOD.row.max_draft)
            # SSD drafts off the critical path on a hit: only misses pay for drafting (charged with the
            # draft model's costs once known). Charging every round stopped it drafting (0.09 drafts a
            # round on HumanEval); charging none made it draft at batch 16, at 0.57x AR. Drafts longer
            # than the draft model's best only lengthen its tree.
            self.ssd = SpeculationPolicy(target_costs, max_draft=Method.SSD.row.max_draft)
        self.max_draft = self.free.max_draft if self.free is not None else fixed
        self._draft_model: SpeculationPolicy | None = None
        self._costs_of: pb.GetCapacityResponse | None = None  # the capacity _draft_model was built from
        self._chosen: DraftLength = self.fixed  # the policy that chose the last round's lengths

    @property
    def draft_model(self) -> SpeculationPolicy | None:
        """The draft-model policy, once an endpoint has told its draft costs (rebuilt on re-attach)."""
        capacity = self.drafter.capacity
        if self.free is None or capacity is None:
            return None
        if capacity is not self._costs_of:
            # Its first plain round probes: routers plan the draft model as a probe (router/decisions.py) for
            # requests that may end before a 16th round, and a probe only at round 16 of a 64-token request
            # left the Qwen pair's figure under the margin (1.04x; it ran 1.3-1.45x through the servers).
            self._draft_model = SpeculationPolicy(self.free.target_costs, self.drafter.draft_costs(),
                                                  max_draft=Method.DRAFT_MODEL.row.max_draft,
                                                  probe=Probe(first=True))
            self._costs_of = capacity
        return self._draft_model

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        plans = [r.plan or LOCAL_NGRAM for r in batch]
        self._chosen = self._policy({p.method for p in plans if p.remote})
        lengths = self._chosen.lengths(batch, acceptance)
        # (A plan of no speculation is offered nothing by the decoder itself: engine/decoding.py `_offers`.)
        return [min(n, p.max_draft_tokens or n) for p, n in zip(plans, lengths)]

    def observe(self, seconds: float) -> None:
        self._chosen.observe(seconds)

    def plain_round_s(self, batch_size: int) -> float | None:
        return self.free.plain_round_s(batch_size) if self.free is not None else None

    def ssd_policy(self) -> SpeculationPolicy | None:
        """SSD's policy, wire time included: the one estimate its rounds are chosen by and the heartbeat
        tells routers (None without measured costs). A hit's drafts were made while the target verified
        and, pushed, are already here: only misses wait for the endpoint's drafting and the round trip."""
        if self.free is None:
            return None
        miss = 1.0 - self.drafter.ssd_hit_ratio.value
        draft = self.draft_model
        # Charged the draft model's costs, but learning its own rounds' slowdown: sharing the draft model's, SSD's
        # rounds (0.89x AR on the Qwen pair, pre-speculation contending for the target's cores) priced the
        # draft model down from 1.48x to 0.74x, and routers kept planning SSD (issue 51).
        policy = self.ssd if draft is None else dataclasses.replace(
            draft, max_draft=self.ssd.max_draft, drafting_share=miss, slowdown=self.ssd.slowdown)
        return dataclasses.replace(policy, round_s=self.drafter.wire_s.value * miss)

    def _policy(self, remote: set[Method]) -> DraftLength:
        if self.free is None:
            return self.fixed
        charges = {m.row.charges for m in remote}
        if "model" in charges and self.draft_model is not None:
            # The head is charged the draft model's costs: the endpoint publishes no others, and a
            # one-layer head costs less than the four-layer draft, so this never predicts a gain it lacks.
            policy = self.draft_model
        elif "misses" in charges:
            return self.ssd_policy()
        else:
            policy = self.free
        return dataclasses.replace(policy, round_s=self.drafter.wire_s.value) if remote else policy
