"""The role every drafter plays, what else one can do, and what it hands the decoder: drafts for a batch of
sequences.

A drafter keeps its own per-sequence state and sees only deltas: the context once, then the
tokens each round appended. Every drafter (the draft model, the head, n-gram, SSD, the remote
endpoint) plugs into `specpool.engine.decoding.Decoder` through this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from specpool.engine.verification.sampling import SamplingParams

if TYPE_CHECKING:
    from specpool.engine.plan import SpeculationPlan


@dataclass(frozen=True, slots=True)
class Drafts:
    """Proposed tokens for a batch of sequences, and how they were chosen.

    With `probs` the tokens were sampled from that dense q; with `topk_ids`/`topk_probs` from the
    top-k-truncated q those pairs describe; with neither they are deterministic (a point mass).
    """

    tokens: list[list[int]]  # ragged: row b may hold 0..K tokens
    probs: torch.Tensor | None = None  # [B, K, V]
    topk_ids: torch.Tensor | None = None  # [B, K, k]
    topk_probs: torch.Tensor | None = None  # [B, K, k]
    # Token trees: row b's node i has parent parents[b][i] (engine/verification/token_tree.py). None: every row is a
    # chain. Tree nodes are deterministic, so trees come without q.
    parents: list[list[int]] | None = None

    @staticmethod
    def empty(batch: int) -> Drafts:
        return Drafts(tokens=[[] for _ in range(batch)])

    def select(self, rows: Sequence[int | None]) -> Drafts:
        """These rows in this order; None: a row without drafts (its q rows are zero, never read)."""
        if list(rows) == list(range(len(self.tokens))):
            return self

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.new_zeros((len(rows), *t.shape[1:]))
            for i, r in enumerate(rows):
                if r is not None:
                    out[i] = t[r]
            return out

        tokens = [list(self.tokens[r]) if r is not None else [] for r in rows]
        parents = None if self.parents is None else [list(self.parents[r]) if r is not None else [] for r in rows]
        return Drafts(tokens, pick(self.probs), pick(self.topk_ids), pick(self.topk_probs), parents)


@dataclass
class Fork:
    """SSD's drafts prepared for one likely outcome, in a KV slot of their own (`outcome_table`)."""

    slot: int
    bonus: int  # the outcome's bonus token, its first fed token
    drafts: list[int]
    rows: list[torch.Tensor]  # candidate ids of rows 0..K-1 (row j: after its bonus and d'1..d'j)
    topk_ids: torch.Tensor | None  # [K, k] the sparse q each draft was sampled from
    topk_probs: torch.Tensor | None
    # The feature predicted after the bonus and after each fed draft (a head's d'_j input).
    predicted: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a drafter can do beyond the role, fixed when it is built: whoever holds one reads them once."""

    # It runs a model on a KV cache of its own (`cache`): it continues from the tokens emitted since its
    # previous drafts, and n drafts take n - 1 positions.
    kv_cache: bool = False
    # No sampler changes its drafts (n-gram: point masses): one propose call serves every sampler.
    deterministic: bool = False
    # `propose` takes `sparse=` (q as top-k pairs, else dense rows) per call: one drafter then serves
    # sequences of either transport.
    sparse_q_per_call: bool = False
    # `propose` takes `tree=` per call: a TreeShape grows token trees of num_tokens nodes each, None
    # drafts chains (or, for a drafter built with a shape, trees of that one).
    grows_trees: bool = False
    # It is Prespeculating: it works while the target verifies (SSD pre-speculates the likely outcomes).
    prespeculates: bool = False
    # Inputs beyond token ids, each passed as the keyword argument of its name: the target's last hidden
    # states (a feature-fed head), to `start` and `observe`; the sequence's SpeculationPlan and sampler (a
    # drafter that serves several methods, and then is Replanning), to `start`.
    features: bool = False
    plan: bool = False
    params: bool = False

    def inputs(self, **offered) -> dict:
        """Those of the offered inputs it reads, as keyword arguments."""
        return {name: value for name, value in offered.items() if getattr(self, name)}


class Drafter(Protocol):
    """The role every drafter plays, local or remote, model or n-gram or SSD: it is told a sequence's
    context once (`start`), proposes drafts for it (`propose`), observes what the target emitted after
    verifying them (`observe`), and forgets it (`release`). What else it can do its `caps` say."""

    caps: Capabilities = Capabilities()

    def start(self, seq_id: str, context: Sequence[int]) -> None: ...

    def propose(
        self,
        seq_ids: Sequence[str],
        num_tokens: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafts: ...

    def observe(self, seq_id: str, tokens: Sequence[int]) -> None:
        """The tokens the target emitted for this sequence in the round just verified: the accepted
        prefix of the last drafts (see accepted_prefix), then the target's own token."""
        ...

    def release(self, seq_id: str) -> None: ...

    def start_groups(self, requests: Sequence[DraftRequest]) -> InFlight:
        """Asks for the drafts of one step's sampling groups. A local drafter makes them now; a remote
        one returns while they are made, and the decoder steps the sequences that wait for none."""
        return Ready([self.propose(r.seq_ids, r.num_tokens, r.params, r.generator) for r in requests])

    def finish_groups(self, in_flight: InFlight) -> list[Drafts]:
        """The drafts `start_groups` asked for, one Drafts per request (waiting for them if need be)."""
        return in_flight.drafts


class Replanning(Protocol):
    """A drafter that reads plans (`caps.plan`)."""

    def replan(self, seq_id: str, plan: SpeculationPlan) -> None:
        """The sequence speculates by `plan` from its next round (the decoder dropped its plan, measured
        slower than plain decoding)."""


class Prespeculating(Drafter, Protocol):
    """A drafter that works while the target verifies (`caps.prespeculates`; SSD): the caller calls
    `prespeculate` after sending drafts, and `adopt` for drafts the target made itself instead."""

    def outcome_arrived(self, seq_id: str, at: float) -> None:
        """When the outcome that `observe` gets next arrived (time.monotonic()): SSD sizes its forks by
        the target's verification time; without it, the time `observe` runs."""

    def served_from_cache(self, seq_id: str) -> bool:
        """Whether the sequence's last drafts were ready before it asked (an SSD hit)."""

    def adopt(self, seq_id: str, drafts: Sequence[int]) -> None:
        """The target verifies drafts of its own next (a miss it resolved locally)."""

    def prespeculate(self, seq_ids: Sequence[str]) -> None:
        """Prepare the next drafts of these sequences for the likely outcomes of their last ones."""

    def outcome_table(self, seq_id: str) -> dict[tuple[int, int], Fork]:
        """The prepared drafts by outcome (accepted drafts, bonus token): what push mode streams out."""

    def fast_backup(self) -> bool:
        """Whether an outcome with no prepared drafts is best met by fast local (n-gram) drafts."""


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One `propose` call's arguments: sequences sharing sampling parameters."""

    seq_ids: list[str]
    num_tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None


def accepted_prefix(drafts: Sequence[int], emitted: Sequence[int]) -> int:
    """How many of the drafts the target accepted, given the tokens it emitted after them: the length
    of their common prefix (the token after it is the target's own)."""
    n = 0
    for draft, token in zip(drafts, emitted, strict=False):
        if draft != token:
            break
        n += 1
    return n


class InFlight(Protocol):
    """Drafts asked for by `start_groups` and not yet collected."""

    @property
    def waiting(self) -> set[str]:
        """The sequences whose drafts are still being made: they must not move until collected."""
        ...

    def ready(self) -> bool:
        """Whether `finish_groups` would return without waiting."""
        ...


@dataclass(frozen=True, slots=True)
class Ready:
    """Drafts made at once: nothing waits."""

    drafts: list[Drafts]
    waiting: frozenset[str] = frozenset()

    def ready(self) -> bool:
        return True


