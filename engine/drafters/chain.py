"""Fallbacks in order: a sequence's round is drafted by the first member of its chain that drafts it.

A member is asked for one sequence's next n drafts and answers with them, or with None: it declines, and
the next member is asked. An answer of no drafts is an answer too: it ends the chain, and nothing drafts
the sequence this round. The remote drafter's chain is [the endpoint, no drafts beside a plain sequence,
the target's n-gram index] (target_service/remote/drafter.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Row = TypeVar("Row")  # one sequence's drafts, as the chain's owner holds them


class DraftChain(Generic[Row]):
    """Members in order, each `member(seq_id, n) -> Row | None` (None: it declines this sequence's round)."""

    def __init__(self, *members: Callable[[str, int], Row | None]):
        self.members = members

    def draft(self, seq_id: str, n: int) -> Row | None:
        """The first member's answer that is not None; None when every member declines."""
        for member in self.members:
            row = member(seq_id, n)
            if row is not None:
                return row
        return None
