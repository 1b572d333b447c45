# Over 400 lines: the one decode loop and the bookkeeping of its rounds (_Asked) read best together.
"""The one decode loop: draft, verify, accept, roll back. AR decoding is the loop with no drafter.

Every drafter (draft model, n-gram, the remote endpoint) goes through `verify_round`, so there is
exactly one place where speculated tokens turn into output.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpool.engine.drafters.base import (
    Capabilities,
    Drafter,
    DraftRequest,
    Drafts,
    InFlight,
    Ready,
    Replanning,
)
from specpool.engine.method import METHODS, Method
from specpool.engine.plan import NO_SPECULATION, SpeculationPlan
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.draft_length import PLAIN_DECODING, DraftLength, FixedDraftLength, Running
from specpool.engine.runtime.model import Llama
from specpool.engine.verification import token_tree
from specpool.engine.verification.rules import (
    TreeVerifyResult,
    VerifyResult,
    verify_dense,
    verify_greedy,
    verify_point_mass,
    verify_sparse,
    verify_tree,
)
from specpool.engine.verification.sampling import (
    SamplingParams,
    logits_to_probs,
    make_generator,
    sample_from_logits,
)

# A plan is judged on this many of its rounds (after its first, which opens sessions and fills caches):
# slower than plain decoding over them and over all its rounds so far, it falls to the next plan down
# (SpeculationPlan.fallback). Judged on the last 4 alone, a run of rejections dropped a pair that pays 1.45x on
# average (the Qwen2.5-Coder pair: `make run`'s prompts each dropped their plan once or twice).
PACED_ROUNDS = 4

# What sampling or verifying one group can raise (torch's errors are RuntimeErrors; a bad draft token
# an IndexError): it ends that group's sequences, not the batch.
SAMPLING_ERRORS = (RuntimeError, ValueError, IndexError)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (a stop token), "length", "cancelled" or "error" (then see `error`)
    error: str = ""
    target_steps: int = 0  # verify/decode forwards after prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per target step
    # Drafts verified at position k + 1 over all rounds (a chain's k+1-th draft, a tree's nodes at depth k),
    # and of them accepted: the accepted path holds one draft per position.
    offered_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    branch_rounds: int = 0  # token trees: rounds whose accepted path left the first-child chain
    plan_drops: int = 0  # times its plan fell to the next one down, measured slower than plain decoding
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        elapsed = self.prefill_s + self.decode_s
        return len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per target step after the first token, bonus included."""
        return (len(self.token_ids) - 1) / self.target_steps if self.target_steps else 0.0

    def count_positions(self, depths: Sequence[int], accepted: int) -> None:
        """One round's drafts by position: `depths` of the drafts verified (0: the first after the last
        emitted token), `accepted` the length of the accepted path."""
        for d in depths:
            while len(self.offered_at) <= d:
                self.offered_at.append(0)
                self.accepted_at.append(0)
            self.offered_at[d] += 1
        for d in range(accepted):
            self.accepted_at[d] += 1


def pad_drafts(drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B, K] right-padded with 0, num_drafts [B])."""
    k = max((len(t) for t in drafts.tokens), default=0)
    return token_tree.padded(drafts.tokens, k), torch.tensor([len(t) for t in drafts.tokens], dtype=torch.long)


def verify_round(
    drafts: Drafts, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """target_logits [B, T, V] with T >= K+1: row i scores the token at draft slot i (row K: the bonus)."""
    tokens, num = pad_drafts(drafts)
    k = tokens.shape[1]
    logits = target_logits[:, : k + 1]
    if params.greedy:
        return verify_greedy(tokens, logits, num)
    p = logits_to_probs(logits, params)  # [B, K+1, V]
    if drafts.probs is not None:
        return verify_dense(tokens, drafts.probs[:, :k], p, num, generator)
    if drafts.topk_ids is not None:
        return verify_sparse(tokens, drafts.topk_ids[:, :k], drafts.topk_probs[:, :k], p, num, generator)
    return verify_point_mass(tokens, p, num, generator)


def verify_tree_round(
    drafts: Drafts, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> TreeVerifyResult:
    """Token trees (`drafts.parents`); target_logits [B, T, V], row 0 the root's, row i+1 node i's.
    A tree's nodes are deterministic (a drafter's likeliest continuations), so no q travels with them."""
    if drafts.probs is not None or drafts.topk_ids is not None:
        raise ValueError("token trees carry no draft probabilities: their nodes must be deterministic")
    tokens, num = pad_drafts(drafts)
    n = tokens.shape[1]
    parents = token_tree.padded(drafts.parents, n, fill=-1)
    logits = target_logits[:, : n + 1]
    if params.greedy:  # the longest path of argmax tokens
        p = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    else:
        p = logits_to_probs(logits, params)
    return verify_tree(tokens, parents, num, p, generator)


class PlanPace:
    """A plan's rounds since its first (which opens sessions and fills caches, so stays out of the judgement)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.recent: deque[tuple[int, float]] = deque(maxlen=PACED_ROUNDS)  # (tokens, seconds)
        self.tokens, self.seconds = 0, 0.0

    def slower(self, tokens: int, seconds: float, plain_s: float) -> bool:
        """Records a round of `tokens` in `seconds`: whether the plan made fewer tokens a second than plain
        decoding (a round of plain_s a token) over its last PACED_ROUNDS rounds and over all its rounds so far.
        Both: a plan slower from its start drops as soon as it is judged, but a short run of rejections in a
        plan that has paid does not drop it."""
        self.rounds += 1
        if self.rounds == 1:
            return False
        self.recent.append((tokens, seconds))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        if len(self.recent) < PACED_ROUNDS:
            return False
        recent_tokens, recent_s = (sum(x) for x in zip(*self.recent))
        return recent_tokens * plain_s < recent_s and self.tokens * plain_s < self.seconds


@dataclass
class _Sequence:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop: frozenset[int]
    result: GenerationResult
    plan: SpeculationPlan | None = None  # how it speculates (None: as the drafter does)
    slot: int = -1
    unseen: int = 0  # tokens the drafter holds but has not run its model over (its catch-up)
    pace: PlanPace = field(default_factory=PlanPace)  # its plan's rounds so far


class Decoder:
    """Continuous batching over one target model: sequences join and leave between steps.

    A step either prefills the sequences added since the last step (emitting their first token) or
    runs one speculative round over every running sequence: draft, one target forward for all,
    verify per sampling-parameter group, accept, roll back. AR decoding is a round with no drafts.
    How many tokens each sequence drafts is `draft_length`'s to say, every round.
    """

    def __init__(
        self,
        model: Llama,
        max_batch: int,
        max_len: int,
        drafter: Drafter | None = None,
        draft_length: DraftLength = PLAIN_DECODING,
        generator: torch.Generator | None = None,
        acceptance: AcceptanceEstimate | None = None,
    ):
        self.model = model
        self.cache = model.new_cache(max_batch, max_len)
        self.drafter = drafter
        self._caps = drafter.caps if drafter is not None else Capabilities()
        self._wants_features = self._caps.features  # a feature-fed head's input
        self._replanning: Replanning | None = drafter if self._caps.plan else None
        self.draft_length = draft_length
        self.acceptance = acceptance or AcceptanceEstimate()  # of sequences without a plan (in process)
        # One per planned method: a draft model's acceptance is not an n-gram index's. Pooled into one, the
        # cheaper n-gram always predicted faster, so routers never planned the Qwen pair's draft model.
        self._acceptances: dict[Method, AcceptanceEstimate] = {}
        self.last_verify_s: float | None = None  # the last round's forward and acceptance, drafting excluded
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []
        self._generator_override = generator  # one stream for every group (reproducible tests)
        self._asked: _Asked | None = None  # the round whose drafts are being made
        self._generators: dict[SamplingParams, torch.Generator] = {}
        self._group_sizes: Counter[SamplingParams] = Counter()  # live sequences per sampling group

    def acceptance_of(self, method: Method | None) -> AcceptanceEstimate:
        """The acceptance measured for sequences planned with `method` (None: those without a plan)."""
        if method is None:
            return self.acceptance
        if method not in self._acceptances:
            prior = self.acceptance
            self._acceptances[method] = AcceptanceEstimate(prior.prior_alpha, prior.prior_weight, prior.decay,
                                                           len(prior.reached))
        return self._acceptances[method]

    def _round_acceptance(self, batch: Sequence[_Sequence]) -> AcceptanceEstimate:
        """The estimate a round's lengths are chosen by: that of its plans' first method in METHODS' order
        (the draft model before n-gram, as the target's policy charges a mixed batch), else the unplanned."""
        planned = {s.plan.method for s in batch if s.plan is not None}
        method = next((row.method for row in METHODS if row.method in planned and row.drafter), None)
        return self.acceptance_of(method)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_slots(self) -> int:
        return self.cache.free_slots - len(self.waiting)

    def add(
        self,
        seq_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: Sequence[int] | None = None,
        plan: SpeculationPlan | None = None,
    ) -> GenerationResult:
        """Queue a sequence; it is prefilled by the next step. Its result fills in as steps run. `plan`:
        how it speculates, which the draft length and a drafter that reads plans follow."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        room = self.cache.max_len - self.draft_length.max_draft - 1
        if len(prompt) + max_new_tokens > room:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds the context of {room}")
        if self.free_slots < 1:
            raise RuntimeError(f"batch full: all {self.cache.max_slots} sequences are running")
        stop = frozenset(stop_ids if stop_ids is not None else self.model.config.stop_ids)
        seq = _Sequence(seq_id, list(prompt), params, max_new_tokens, stop, GenerationResult(list(prompt)), plan)
        self.waiting.append(seq)
        self._group_sizes[params] += 1
        return seq.result

    def cancel(self, seq_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    seq.result.finish_reason = "cancelled"
                    queue.remove(seq)
                    self._release(seq, started=queue is self.running)
                    return True
        return False

    def step(self) -> list[tuple[str, list[int]]]:
        """One prefill or one round -> (seq_id, tokens appended) for every sequence that moved;
        a sequence whose result has a finish_reason has left the batch."""
        self.last_verify_s = None
        if self.waiting:
            return self._prefill()
        if self.running:
            return self._round()
        return []

    # -- internals --------------------------------------------------------------------------

    def _generator(self, params: SamplingParams) -> torch.Generator:
        if self._generator_override is not None:
            return self._generator_override
        if params not in self._generators:
            self._generators[params] = make_generator(params.seed)
        return self._generators[params]

    def _emit(self, seq: _Sequence, tokens: Sequence[int]) -> list[int]:
        """Append tokens up to a stop token or the length limit; -> what was appended."""
        res, taken = seq.result, []
        for t in tokens:
            if len(res.token_ids) >= seq.max_new_tokens:
                break
            res.token_ids.append(t)
            taken.append(t)
            if t in seq.stop:
                res.finish_reason = "stop"
                break
        if not res.finish_reason and len(res.token_ids) >= seq.max_new_tokens:
            res.finish_reason = "length"
        return taken

    @staticmethod
    def _fail(seqs: list[_Sequence], error: Exception) -> list[tuple[str, list[int]]]:
        """Ends the sequences of one sampling group whose sampling or verification raised (their
        parameters or their drafts); the other groups' rows go on. Slots free with the finished ones'."""
        for seq in seqs:
            seq.result.finish_reason = "error"
            seq.result.error = f"{type(error).__name__}: {error}"
        return [(seq.seq_id, []) for seq in seqs]

    def _release(self, seq: _Sequence, started: bool) -> None:
        if started:
            self.cache.release(seq.slot)
            if self.drafter is not None:
                self.drafter.release(seq.seq_id)
        # A group's random stream ends with its last sequence: a seeded request sent again draws afresh
        # from its seed, and the distinct parameters a long-lived decoder has seen are not all kept.
        self._group_sizes[seq.params] -= 1
        if self._group_sizes[seq.params] <= 0:
            del self._group_sizes[seq.params]
            self._generators.pop(seq.params, None)

    def _forward(self, batch: list[_Sequence], feed: list[list[int]], all_logits: bool, parents=None,
                 prefill: bool = False):
        """The target's forward over the batch -> (logits, its features [B, T, d] when the drafter reads
        them, else None)."""
        out = self.model.forward(self.cache, [s.slot for s in batch], feed, all_logits=all_logits,
                                 features=self._wants_features, parents=parents, prefill=prefill)
        return out if self._wants_features else (out, None)

    @staticmethod
    def _inputs(hidden: torch.Tensor | None, row: int, fed: list[int]) -> dict:
        """What the drafter declared it reads beyond token ids, at these fed positions of a row."""
        return {} if hidden is None else {"features": hidden[row, fed].clone()}

    def _prefill(self) -> list[tuple[str, list[int]]]:
        start = time.perf_counter()
        batch, self.waiting = self.waiting, []
        for seq in batch:
            seq.slot = self.cache.allocate()
        logits, hidden = self._forward(batch, [s.prompt for s in batch], all_logits=False, prefill=True)  # [B, V]
        moved = []
        for rows, params in _groups(batch):
            try:
                firsts = sample_from_logits(logits[rows], params, self._generator(params)).tolist()
            except SAMPLING_ERRORS as e:
                moved += self._fail([batch[r] for r in rows], e)
                continue
            for r, t in zip(rows, firsts):
                seq = batch[r]
                moved.append((seq.seq_id, self._emit(seq, [t])))
        elapsed = time.perf_counter() - start
        for r, seq in enumerate(batch):
            seq.result.prefill_s = elapsed
            if seq.result.finish_reason:
                self._release(seq, started=True)
                continue
            self.running.append(seq)
            if self.drafter is not None:
                inputs = self._inputs(hidden, r, list(range(len(seq.prompt))))
                # The sequence's own plan and sampler, to a drafter that declares it reads them.
                inputs |= self._caps.inputs(plan=seq.plan, params=seq.params)
                self.drafter.start(seq.seq_id, seq.prompt + seq.result.token_ids, **inputs)
                seq.unseen = len(seq.prompt) + 1
        return moved

    def _offers(self, batch: list[_Sequence]) -> dict[str, int]:
        """seq_id -> positions offered to the drafter this round."""
        remaining = [s.max_new_tokens - len(s.result.token_ids) for s in batch]
        if self.drafter is None:
            lengths = [0] * len(batch)
        else:
            lengths = self.draft_length.lengths(
                [Running(s.seq_id, s.unseen, r, s.plan) for s, r in zip(batch, remaining)],
                self._round_acceptance(batch))
        # Never draft past the length limit: the bonus token always fills the last place. A sequence
        # planned (or dropped) to no speculation is offered nothing, whatever the drafter could do.
        return {s.seq_id: 0 if s.plan is not None and s.plan.method is Method.NONE else min(n, r - 1)
                for s, n, r in zip(batch, lengths, remaining)}

    def _round(self) -> list[tuple[str, list[int]]]:
        """Asks for drafts, then verifies them for every running sequence in one forward. While a remote
        drafter's reply is out, the sequences that wait for no remote drafts (plain decoding, local
        drafts) step on their own, so they never wait for another sequence's drafts."""
        running = {s.seq_id for s in self.running}
        if self._asked is not None and self._asked.waiting() and not self._asked.waiting() & running:
            self._asked = None  # every sequence it asked for has left: nothing to wait for
        if self._asked is None:
            self._asked = self._ask_drafts()
        asked = self._asked
        waiting = asked.waiting() & running
        side = [s for s in self.running if s.seq_id not in waiting]
        if waiting and side and not asked.ready():
            asked.moved.update(s.seq_id for s in side)  # their drafts of this round are stale now
            return self._verify(side)
        self._asked = None
        return self._verify(self.running, asked)

    def _pace(self, drafted: list[_Sequence], taken: dict[str, list[int]], round_s: float) -> None:
        """Times the plans of the sequences offered drafts this round; one slower than plain decoding
        (PlanPace.slower) falls to the next plan down."""
        plain_s = self.draft_length.plain_round_s(len(self.running))
        if plain_s is None:
            return
        for seq in drafted:
            if seq.result.finish_reason:
                continue
            if seq.pace.slower(len(taken.get(seq.seq_id, [])), round_s, plain_s):
                seq.plan = seq.plan.fallback() if seq.plan is not None else NO_SPECULATION
                seq.pace = PlanPace()
                seq.result.plan_drops += 1
                if self._replanning is not None:
                    self._replanning.replan(seq.seq_id, seq.plan)

    def _ask_drafts(self) -> _Asked:
        start = time.perf_counter()
        batch = self.running
        offered = self._offers(batch)
        asks = []
        for rows, params in _groups(batch):
            budget = [offered[batch[r].seq_id] for r in rows]
            if any(budget):
                asks.append(DraftRequest([batch[r].seq_id for r in rows], budget, params, self._generator(params)))
        asked = _Asked(offered, asks, self.drafter, self.drafter.start_groups(asks) if asks else Ready([]))
        asked.drafting_s = time.perf_counter() - start
        return asked

    def _verify(self, batch: list[_Sequence], asked: _Asked | None = None) -> list[tuple[str, list[int]]]:
        """One target forward over `batch`: the drafts `asked` for (None: a step without drafts)
        verified, accepted, rolled back. Sequences that moved since the ask, or joined, have none."""
        drafted = asked.collect(self.model.config.vocab_size) if asked is not None else {}
        # The sequences this round was asked for (and that did not move since): its acceptance and time.
        ours = set() if asked is None else {s.seq_id for s in batch if s.seq_id in asked.offered} - asked.moved
        start = time.perf_counter()
        groups = _groups(batch)
        drafts = []
        for rows, _ in groups:
            picked = [drafted.get(batch[r].seq_id) for r in rows]
            source = next((d for d, _ in filter(None, picked)), None)
            drafts.append(source.select([p[1] if p else None for p in picked]) if source else Drafts.empty(len(rows)))
        row_drafts: list[list[int]] = [[] for _ in batch]
        fed_parents: list[list[int]] = [[-1] for _ in batch]  # the last token, then the nodes (chains: -1, 0, ..)
        for (rows, _), d in zip(groups, drafts):
            for b, r in enumerate(rows):
                row_drafts[r] = d.tokens[b]
                node_parents = d.parents[b] if d.parents is not None else token_tree.chain(len(d.tokens[b]))
                fed_parents[r] += [p + 1 for p in node_parents]
        feed = [[seq.result.token_ids[-1], *row_drafts[r]] for r, seq in enumerate(batch)]
        trees = any(d.parents is not None for d in drafts)
        logits, hidden = self._forward(batch, feed, all_logits=True, parents=fed_parents if trees else None)

        moved = []
        for (rows, params), d in zip(groups, drafts):
            try:
                if d.parents is not None:
                    outcome = verify_tree_round(d, logits[rows], params, self._generator(params))
                    paths = [row[:a] for row, a in zip(outcome.path.tolist(), outcome.accepted.tolist())]
                    for r, parents, path in zip(rows, d.parents, paths):
                        branched = path != token_tree.first_children(parents)[: len(path)]
                        batch[r].result.branch_rounds += branched
                else:
                    outcome = verify_round(d, logits[rows], params, self._generator(params))
                    paths = [list(range(a)) for a in outcome.accepted.tolist()]
            except SAMPLING_ERRORS as e:
                moved += self._fail([batch[r] for r in rows], e)
                continue
            for b, (r, path, next_token) in enumerate(zip(rows, paths, outcome.next_token.tolist())):
                seq, proposed = batch[r], d.tokens[b]
                res = seq.result
                res.target_steps += 1
                res.drafted_tokens += len(proposed)
                res.accepted_tokens += len(path)
                res.rounds.append((len(proposed), len(path)))
                depths = token_tree.depths(d.parents[b]) if d.parents is not None else range(len(proposed))
                res.count_positions(depths, len(path))
                if seq.seq_id in ours:
                    estimate = self.acceptance_of(seq.plan.method if seq.plan is not None else None)
                    estimate.update(len(path), asked.offered[seq.seq_id], len(proposed))
                # Keep the fed last token and the accepted path's K/V, in place; drop the rest.
                kept = [0] + [node + 1 for node in path]
                self.cache.keep_path(seq.slot, self.cache.lengths[seq.slot] - len(feed[r]), kept)
                taken = self._emit(seq, [proposed[node] for node in path] + [next_token])
                moved.append((seq.seq_id, taken))
                if self.drafter is not None and not res.finish_reason:
                    self.drafter.observe(seq.seq_id, taken, **self._inputs(hidden, r, kept[: len(taken)]))
                    # Accepted drafts are already in the drafter's cache; the rest is new to it.
                    seq.unseen = (0 if proposed else seq.unseen) + len(taken) - min(len(path), len(taken))
        end = time.perf_counter()
        self.last_verify_s = end - start
        if asked is not None:  # a round the draft length was chosen for: what it took, drafting included
            self.draft_length.observe(asked.drafting_s + self.last_verify_s)
            self._pace([s for s in batch if s.seq_id in ours and asked.offered[s.seq_id] > 0],
                        dict(moved), asked.drafting_s + self.last_verify_s)
        for seq in batch:
            # Drafting counts for the sequences it drafted for: the time they waited for their drafts.
            seq.result.decode_s += end - start + (asked.drafting_s if seq.seq_id in ours else 0.0)
            if seq.result.finish_reason:
                self._release(seq, started=True)
        self.running = [s for s in self.running if not s.result.finish_reason]
        return moved


@dataclass
class _Asked:
    """One round's drafts, asked for: here already, or on their way from a remote drafter."""

    offered: dict[str, int]  # seq_id -> positions offered to the drafter
    asks: list[DraftRequest]
    drafter: Drafter | None
    in_flight: InFlight  # drafter.start_groups(asks)
    moved: set[str] = field(default_factory=set)  # stepped meanwhile: their drafts no longer fit
    drafting_s: float = 0.0  # asking and collecting, the wait for a remote reply included

    def waiting(self) -> set[str]:
        return set(self.in_flight.waiting)

    def ready(self) -> bool:
        return self.in_flight.ready()

    def collect(self, vocab_size: int) -> dict[str, tuple[Drafts, int]]:
        """seq_id -> (its group's Drafts, its row), less the sequences that moved since the ask."""
        start = time.perf_counter()
        drafts = self.drafter.finish_groups(self.in_flight) if self.asks else []
        self.drafting_s += time.perf_counter() - start
        out = {}
        for ask, d in zip(self.asks, drafts):
            # A token the target cannot embed would fail the whole batch's forward: drop the group's drafts.
            if not all(0 <= t < vocab_size for row in d.tokens for t in row):
                continue
            if d.parents is not None:  # a malformed tree too (it would fail the forward's layout)
                try:
                    for row, parents in zip(d.tokens, d.parents, strict=True):
                        token_tree.check_tree(row, parents)
                except ValueError:
                    continue
            out.update((s, (d, b)) for b, s in enumerate(ask.seq_ids) if s not in self.moved)
        return out


def _groups(batch: Sequence[_Sequence]) -> list[tuple[list[int], SamplingParams]]:
    """Row indices of the batch grouped by sampling parameters (each group verifies together)."""
    by_params: dict[SamplingParams, list[int]] = {}
    for r, seq in enumerate(batch):
        by_params.setdefault(seq.params, []).append(r)
    return [(rows, params) for params, rows in by_params.items()]


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    num_draft_tokens: int = 0,
    stop_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    policy: DraftLength | None = None,
    acceptance: AcceptanceEstimate | None = None,
) -> list[GenerationResult]:
    """Decode all prompts together (ragged batch); speculate with `drafter` when given.

    The draft length is `num_draft_tokens`, or, with a `policy`, chosen every step from the
    batch size and the acceptance measured so far (in `acceptance`, carried from earlier calls
    the way a server's decoder carries it across requests; a fresh estimate when None).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    draft_length = policy if policy is not None else FixedDraftLength(num_draft_tokens)
    max_len = max(len(p) for p in prompts) + max_new_tokens + draft_length.max_draft + 1
    decoder = Decoder(model, len(prompts), max_len, drafter, draft_length, generator, acceptance)
    results = [decoder.add(str(i), p, params, max_new_tokens, stop_ids) for i, p in enumerate(prompts)]
    while decoder.has_work:
        decoder.step()
    return results
