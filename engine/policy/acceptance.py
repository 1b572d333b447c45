"""E(s): the tokens a draft of length s yields per verify step, measured per draft position from recent
rounds, or from one per-token acceptance alpha."""

from __future__ import annotations

from collections.abc import Callable


class AcceptanceEstimate:
    """How many tokens a draft of length s yields per verify step, from recent rounds.

    Per draft position j it keeps (decayed) counts of the rounds that reached j (drafts 1..j-1
    accepted) and of those that accepted it: a survival estimate, not one per-token alpha. Drafts
    are not i.i.d.: an n-gram draft that matches a copied run tends to keep matching, so later
    positions are accepted more often than the first, and a single alpha would underrate long
    drafts. A position seen rarely leans on the one before it (the first on `prior_alpha`), so
    lengths never drafted yet are predicted from the deepest one measured.
    """

    def __init__(self, prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98,
                 max_len: int = 32):
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.decay = decay
        self.reached = [0.0] * max_len
        self.accepted = [0.0] * max_len
        self.offers = self.fills = 0.0  # rounds that offered positions, and those the drafter filled

    def update(self, accepted: int, offered: int, drafted: int) -> None:
        """One sequence's round that offered the drafter `offered` positions, of which it filled
        `drafted`. An empty position (an n-gram index with no match, a short draft) counts as a
        rejection: the policy must predict what an offer yields, not what a made draft does. Rounds
        that offered nothing fade the counts back toward the prior: a policy that stopped drafting
        must try again eventually."""
        self.reached = [self.decay * r for r in self.reached]
        self.accepted = [self.decay * a for a in self.accepted]
        for j in range(min(accepted + 1, offered, len(self.reached))):
            self.reached[j] += 1
            self.accepted[j] += j < accepted
        if offered:
            self.offers = self.decay * self.offers + 1
            self.fills = self.decay * self.fills + (drafted > 0)

    @property
    def fill(self) -> float:
        """The share of offers the drafter fills at all (1 for a draft model; an n-gram index finds a
        match for only some contexts). A batch in which no row drafted costs a plain step."""
        return (self.fills + self.prior_weight) / (self.offers + self.prior_weight)

    def expected_tokens(self, draft_len: int) -> float:
        """Tokens per sequence per verify step (bonus included) for drafts of this length."""
        total, survive, p = 1.0, 1.0, self.prior_alpha
        for j in range(draft_len):
            if j < len(self.reached):
                weight = self.reached[j] + self.prior_weight
                p = (self.accepted[j] + self.prior_weight * p) / weight if weight else p
            survive *= p
            total += survive
        return total


def expected_tokens(alpha: float, draft_len: int) -> float:
    """Tokens per sequence per verify step (bonus included) with i.i.d. per-token acceptance alpha."""
    if alpha >= 1.0:
        return draft_len + 1.0
    return (1 - alpha ** (draft_len + 1)) / (1 - alpha)


Expected = Callable[[int], float]  # draft length -> tokens per sequence per verify step


def as_expected(acceptance: Expected | float) -> Expected:
    """A per-token acceptance alpha (i.i.d. drafts) or a measured curve, as a curve."""
    if callable(acceptance):
        return acceptance
    return lambda s: expected_tokens(acceptance, s)
