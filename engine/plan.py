"""A sequence's speculation plan: how it speculates, carried with it into the decoder; and the shape of
a round's draft trees (TreeShape).

The target's servicer makes one per request from what it asked (its method, where it drafts, its cap,
chains or trees); the decoder keeps it in the sequence's record and hands it on: to the draft-length
policy every round (`Running.plan`) and, at start, to a drafter that declares it reads it (the remote
drafter opens its session from it). No one parks it elsewhere and reads it back by the sequence's id.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpool.engine.method import LOCAL_METHOD, Method


@dataclass(frozen=True, slots=True)
class SpeculationPlan:
    method: Method
    remote: bool  # drafted on the speculation endpoint; False: on this target (its n-gram index)
    max_draft_tokens: int = 0  # the request's own cap on drafts per round (0: none)
    tree: bool = False  # token trees of a round's draft budget in nodes, not chains

    @staticmethod
    def of(method: Method | None, has_endpoint: bool, max_draft_tokens: int = 0, tree: bool = False) -> SpeculationPlan:
        """A request's method (None: the server's default, the draft model). Without an endpoint every
        speculating method drafts with the target's own n-gram index."""
        method = Method.DRAFT_MODEL if method is None else method
        if method is Method.NONE:
            return SpeculationPlan(Method.NONE, False, max_draft_tokens)
        if not has_endpoint:
            return SpeculationPlan(LOCAL_METHOD, False, max_draft_tokens, tree)
        return SpeculationPlan(method, True, max_draft_tokens, tree)

    def fallback(self) -> SpeculationPlan:
        """The next plan down, for a sequence whose rounds measured slower than plain decoding: from the
        endpoint to the target's own n-gram index (which costs the pool nothing), from that to none.
        Not from one remote method to another: a session re-opened under the same id would race its
        own close on the endpoint."""
        if self.method is Method.NONE or (self.method is LOCAL_METHOD and not self.remote):
            return NO_SPECULATION
        return SpeculationPlan(LOCAL_METHOD, False, self.max_draft_tokens, self.tree)

    @property
    def label(self) -> str:
        """Its name in metrics and SpeculationStats: the method, or ngram_local for the target's own."""
        return "ngram_local" if self.method is LOCAL_METHOD and not self.remote else self.method.value


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The shape of a round's draft trees (engine/drafters/trees.py grows them)."""

    branch: int = 4  # candidate children per expanded node
    beam: int = 4  # nodes expanded per level
    max_depth: int = 8

    @property
    def fed_room(self) -> int:
        """Draft-cache positions a growing tree may take past the sequence: the beam fed per level
        below the first (the last level's candidates are never fed)."""
        return self.beam * (self.max_depth - 1)


LOCAL_NGRAM = SpeculationPlan(LOCAL_METHOD, remote=False)
NO_SPECULATION = SpeculationPlan(Method.NONE, remote=False)
