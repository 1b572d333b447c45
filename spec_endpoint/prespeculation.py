"""Work between rounds, for drafters that pre-speculate (SSD): after a step's replies leave, while the
targets verify them, each such drafter prepares the next drafts of the sessions it just drafted for;
push-mode sessions get those as outcome tables on their Rounds stream at once."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from specpool.engine.method import MAX_DRAFT_TOKENS
from specpool.spec_endpoint.messages import OutcomeTable, RoundResult, SequenceRound
from specpool.spec_endpoint.streams import RoundStream

if TYPE_CHECKING:
    from specpool.engine.drafters.base import Prespeculating
    from specpool.engine.method import Method
    from specpool.spec_endpoint.drafters import HostedDrafters
    from specpool.spec_endpoint.metrics import EndpointMetrics
    from specpool.spec_endpoint.sessions import Session, SessionTable


def local_drafts_error(seq: SequenceRound, vocab_size: int) -> str:
    """Why a drafter cannot pre-speculate after a round's local drafts ("" when it can)."""
    if not seq.new_tokens:  # the glue computes the first draft's row from the last new token
        return "new_tokens: empty, but local drafts follow the tokens emitted since the previous round"
    if len(seq.drafts_in_use) > MAX_DRAFT_TOKENS:
        return f"drafts_in_use: {len(seq.drafts_in_use)} drafts, over {MAX_DRAFT_TOKENS}"
    bad = next((t for t in seq.drafts_in_use if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"drafts_in_use: token id {bad} outside the vocabulary [0, {vocab_size})"
    return ""


class Prespeculation:
    """The sessions whose drafters pre-speculate after this step, by (model, drafter kind)."""

    def __init__(self, drafters: HostedDrafters, sessions: SessionTable, metrics: EndpointMetrics):
        self.drafters = drafters
        self.sessions = sessions
        self.metrics = metrics
        self._pending: dict[tuple[str, Method], list[Session]] = {}  # sessions with fresh drafts

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, drafter: Prespeculating | None, sessions: list[Session]) -> None:
        """Sessions whose drafter just handed out (or adopted) drafts: pre-speculate after them (None: a
        drafter that does not pre-speculate)."""
        if drafter is not None:
            for s in sessions:
                self._pending.setdefault((s.model, s.kind), []).append(s)

    def run(self) -> list[tuple[RoundStream, OutcomeTable]]:
        """Pre-speculate for every pending session still open; -> the outcome tables of push-mode ones."""
        pending, self._pending = self._pending, {}
        tables = []
        for (model, kind), sessions in pending.items():
            drafter = self.drafters.get(model).prespeculating[kind]
            live = [s for s in sessions if self.sessions.get(s.key) is s]
            start = time.monotonic()
            drafter.prespeculate([s.key.drafter_id for s in live])
            self.metrics.busy.add(start, time.monotonic())
            self.metrics.observe_prespeculation(model, drafter)
            for s in live:
                if s.push and s.stream is not None:
                    tables.append((s.stream, outcome_table(s, drafter)))
        return tables


def outcome_table(session: Session, drafter: Prespeculating) -> OutcomeTable:
    entries = []
    for (k, bonus), fork in drafter.outcome_table(session.key.drafter_id).items():
        if fork.topk_ids is not None:
            sk = fork.topk_ids.shape[-1]
            entries.append((k, bonus, fork.drafts, fork.topk_ids.reshape(-1).tolist(),
                            fork.topk_probs.reshape(-1).tolist(), sk))
        else:
            entries.append((k, bonus, fork.drafts, [], [], 0))
    return OutcomeTable(session.key.request_id, list(session.last_drafts), entries, fast_backup=drafter.fast_backup())


def push(tables: list[tuple[RoundStream, OutcomeTable]]) -> None:
    """One reply per stream, with every table for its sessions."""
    by_stream: dict[int, tuple[RoundStream, list[OutcomeTable]]] = {}
    for stream, table in tables:
        by_stream.setdefault(id(stream), (stream, []))[1].append(table)
    for stream, batch in by_stream.values():
        stream.outbound.put(RoundResult(round_id=0, sequences=[], tables=batch))
