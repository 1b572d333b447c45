# Over 400 lines: one drafter's state machine (hand out, observe a hit or a miss, pre-speculate, glue) over one sequence record.
"""SSD (speculative speculative decoding) with Saguaro sampling: drafting off the critical path.

While the target verifies a round of drafts d1..dK, the drafter prepares the next round for the
likely outcomes. An outcome is (k, b): k drafts accepted, then the target's bonus token b. A
rejected draft is never the bonus, so for k < K the candidates for b are the draft's own top
tokens at position k with d_{k+1} masked out; for k = K, its top tokens after dK. Each candidate
(k, b) forks the draft's KV cache after context + d1..dk, and all forks of all sequences are
decoded together, K steps, into a speculation cache keyed by (sequence, k, b). When the outcome
arrives: a hit hands out the cached drafts with no drafting time; a miss falls back per sequence to
a neural backup (draft now) or a fast one (n-gram), whichever the measured figures say is faster.

Sampling (temperature > 0) draws from Saguaro's rescaled draft distribution
sigma(z)_t ~ C * exp(z_t) on the top-F tokens, exp(z_t) elsewhere (C <= 1 pushes rejections onto
the forks' tokens: fewer accepts, more hits), truncated to its top `q_top_k` tokens; that exact q
travels with the drafts, so the verifier stays lossless.

SSD runs the model drafters' one loop (drafters/loop.py) on its feed (drafters/feeds.py): with a
feature-fed head, a fork (k, b) feeds b with the feature the head predicted after d_k, and each draft
with the one it predicted at the step before; what of the cache survives an outcome is the feed's to
say. A miss's fast backup is the n-gram drafter where the registry has one.

The figures SSD measures, and the fan-out it sizes from them, are in drafters/ssd_stats.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpool.engine.drafters.base import Capabilities, Drafter, Drafts, Fork, Prespeculating, accepted_prefix
from specpool.engine.drafters.feeds import DraftState, feed_for
from specpool.engine.drafters.loop import draft_steps, sample_top_k
from specpool.engine.drafters.ssd_stats import SsdStats, ema, geometric_fanout
from specpool.engine.method import MAX_DRAFT_TOKENS
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs

Outcome = tuple[int, int]  # (accepted drafts k, bonus token b)


@dataclass(slots=True)
class _Seq(DraftState):
    """A sequence's DraftState (its `drafts` handed out, awaiting their outcome) and SSD's own record."""

    params: SamplingParams = field(default_factory=SamplingParams)
    rows: list[torch.Tensor] = field(default_factory=list)  # candidate ids per draft row known so far
    # predicted[k]: the feature predicted after the prefix and d1..dk (a head's input of d_{k+1} or of a
    # fork's bonus).
    predicted: list[torch.Tensor] = field(default_factory=list)
    forks: dict[Outcome, Fork] = field(default_factory=dict)
    ready: Fork | None = None  # a hit: the next drafts, already decoded (d'1..d'_{K-1} in the cache)
    q: tuple[torch.Tensor, torch.Tensor] | None = None  # sparse q of neural drafts: ids, probs [K, k]
    source: str = "neural"  # where the outstanding drafts came from: cache, neural, fast
    handed_out_at: float = 0.0
    arrived_at: float = 0.0  # when their outcome arrived, if the caller said (outcome_arrived)


class SsdDrafter(Prespeculating):
    """The Drafter for SSD: the model drafters' loop on a cache with room for forks, Prespeculating.
    `fast`: the drafter a miss may fall back to."""

    CANDIDATES = 16  # ids kept per draft row, to fork from and to rank the real bonus among
    # A pass should end within this share of the verify time: an outcome that arrives before its
    # outcome table finds no hit. Forks per sequence go up or down by one until passes fit.
    PRESPEC_SHARE = 0.8

    def __init__(
        self,
        model: Llama,
        max_sequences: int,
        max_len: int,
        fork_slots: int = 64,
        fork_budget: int = 8,
        saguaro_c: float = 1.0,
        q_top_k: int = 32,
        fast: Drafter | None = None,
        backup: str = "auto",  # auto (from measured figures), neural or fast
    ):
        self.model = model
        self.feed = feed_for(model)
        self.caps = Capabilities(kv_cache=True, prespeculates=True, features="features" in self.feed.inputs)
        self.cache = model.new_cache(max_sequences + fork_slots, max_len)
        self.fork_budget = fork_budget  # the most forks per sequence
        self.forks = max(1, fork_budget // 2)  # forks per sequence now (sized by _size_forks)
        self.saguaro_c = saguaro_c
        self.q_top_k = q_top_k
        if backup == "fast" and fast is None:
            raise ValueError("backup='fast' needs a fast drafter (fast=)")
        self.fast = fast
        self.backup_mode = backup if fast is not None else "neural"
        self.stats = SsdStats()
        self.generator = torch.Generator().manual_seed(0)
        self.lookahead = 0  # drafts per fork: what the target asked for last
        self._seqs: dict[str, _Seq] = {}

    # -- Drafter protocol -----------------------------------------------------------------------

    def start(self, seq_id: str, context: Sequence[int], features: torch.Tensor | None = None) -> None:
        """A head's features [len(context) - 1, d]: the target's at every context position but the
        last (feature i pairs with context[i + 1]); a draft model takes none."""
        pending, features = self.feed.first_feed(context, features)
        self._seqs[seq_id] = _Seq(self.cache.allocate(), pending, features)
        if self.fast is not None:
            self.fast.start(seq_id, context)

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if self.fast is not None:
            self.fast.release(seq_id)
        if seq is not None:
            self._drop_forks(seq)
            self.cache.release(seq.slot)

    def outcome_arrived(self, seq_id: str, at: float) -> None:
        self._seqs[seq_id].arrived_at = at

    def observe(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        """The verification outcome of the outstanding drafts (and anything emitted since), which
        arrived when `outcome_arrived` said (default: now). A head's features [len(tokens), d]: the
        target's at the position before each token."""
        self.feed.check(len(tokens), features, "emitted tokens")
        seq = self._seqs[seq_id]
        if self.fast is not None:
            self.fast.observe(seq_id, tokens)
        if seq.ready is not None:  # a hit nobody drafted from
            self._unready(seq)
        drafts = seq.drafts
        k = accepted_prefix(drafts, tokens)
        if drafts:
            self.stats.learn(k, tokens, drafts, seq.rows, seq.source, forked=seq.forks.keys())
        fork = seq.forks.pop((k, tokens[k]), None) if seq.forks and len(tokens) == k + 1 else None
        if drafts and seq.handed_out_at:
            arrived = seq.arrived_at or time.monotonic()
            self.stats.verify_s = ema(self.stats.verify_s, arrived - seq.handed_out_at)
        seq.arrived_at = 0.0
        self._drop_forks(seq)
        if fork is not None:
            # Hit: the fork already holds context + d1..dk + b + its own drafts; it becomes the sequence
            # (cut back as the feed says: its drafts are handed out all the same).
            self.cache.release(seq.slot)
            seq.slot, seq.ready = fork.slot, fork
            self.feed.observe_hit(self.cache, seq, tokens, features)
        else:
            self.feed.observe(self.cache, seq, tokens, features)
        seq.drafts, seq.fed, seq.rows, seq.predicted = [], 0, [], []

    def propose(self, seq_ids, num_tokens, params, generator) -> Drafts:
        sampled = not params.greedy
        self.lookahead = max(num_tokens, default=0) or self.lookahead
        out_tokens: list[list[int]] = [[] for _ in seq_ids]
        q_ids: list[torch.Tensor | None] = [None] * len(seq_ids)
        q_probs: list[torch.Tensor | None] = [None] * len(seq_ids)
        neural = []
        for b, (sid, n) in enumerate(zip(seq_ids, num_tokens)):
            seq = self._seqs[sid]
            seq.params = params
            if n <= 0:
                continue
            if seq.ready is not None:
                fork = seq.ready
                n = min(n, len(fork.drafts))
                seq.drafts, seq.rows, seq.predicted = fork.drafts[:n], fork.rows[:n], fork.predicted[:n]
                # The fork fed d'1..d'_{K-1}; as after any propose, keep d'1..d'_{n-1} where the feed keeps drafts.
                seq.fed = self.feed.keep_hit_drafts(self.cache, seq, len(fork.drafts) - 1, n)
                out_tokens[b] = list(seq.drafts)
                if sampled:
                    q_ids[b], q_probs[b] = fork.topk_ids[:n], fork.topk_probs[:n]
                seq.source, seq.ready = "cache", None
            elif self.choose_backup() == "fast":
                seq.ready = None
                seq.drafts, seq.fed, seq.rows, seq.source = self.fast.propose([sid], [n], params, None).tokens[0], 0, [], "fast"
                out_tokens[b] = list(seq.drafts)
                self.stats.backups["fast"] += 1
            else:
                seq.ready = None
                neural.append(b)
                self.stats.backups["neural"] += 1
        if neural:
            start = time.monotonic()
            self._draft_neural([seq_ids[b] for b in neural], [num_tokens[b] for b in neural], params)
            self.stats.neural_s = ema(self.stats.neural_s, time.monotonic() - start)
            for b in neural:
                seq = self._seqs[seq_ids[b]]
                out_tokens[b] = list(seq.drafts)
                if sampled:
                    q_ids[b], q_probs[b] = seq.q
        now = time.monotonic()
        for sid, n in zip(seq_ids, num_tokens):
            if n > 0:
                self._seqs[sid].handed_out_at = now
        if not sampled:
            return Drafts(tokens=out_tokens)
        k = min(self.q_top_k, self.model.config.vocab_size)
        return Drafts(tokens=out_tokens, **_sparse(out_tokens, q_ids, q_probs, k))

    # -- pre-speculation ------------------------------------------------------------------------------

    def prespeculate(self, seq_ids: Sequence[str]) -> None:
        """Build the speculation cache for the outstanding drafts of these sequences (one glue
        forward, then K tree-decode forwards over every fork of every sequence)."""
        k_next = max(self.lookahead, 1)
        seqs = [(sid, self._seqs[sid]) for sid in seq_ids
                if sid in self._seqs and self._seqs[sid].drafts and self._has_room(self._seqs[sid], k_next)]
        if not seqs:
            return
        start = time.monotonic()
        self._glue([s for _, s in seqs])
        per_seq = max(1, min(self.forks, self.cache.free_slots // len(seqs)))
        fanout = geometric_fanout(per_seq, k_next, self.stats.accept_ema, self.stats.miss_exponent())
        forks: list[tuple[_Seq, Outcome, int]] = []  # (sequence, outcome, prefix length)
        for _, seq in seqs:
            K = len(seq.drafts)
            base = self.cache.lengths[seq.slot] - K
            for k in range(K + 1):
                f = fanout[min(k, len(fanout) - 1)] if k < K else fanout[-1]
                banned = seq.drafts[k] if k < K else -1
                for b in [t for t in seq.rows[k].tolist() if t != banned][:f]:
                    if len(forks) >= self.cache.free_slots:  # each fork takes a slot in _tree_decode
                        break
                    forks.append((seq, (k, b), base + k))
        if forks:
            self._tree_decode(forks, k_next)
        elapsed = time.monotonic() - start
        self.stats.prespec_s = ema(self.stats.prespec_s, elapsed)
        self._size_forks(elapsed, k_next)

    def _has_room(self, seq: _Seq, k_next: int) -> bool:
        """Whether the cache holds this sequence glued (context + d1..dK) plus a fork's bonus and
        drafts: near the end of the cache, a sequence is drafted on demand instead of pre-speculated."""
        glued = self.cache.lengths[seq.slot] + len(seq.pending) + len(seq.drafts) - seq.fed
        return glued + k_next <= self.cache.max_len

    def _size_forks(self, elapsed: float, k_next: int) -> None:
        """One fork per sequence fewer when a pass overran its share of the verify time, one more
        when it left a quarter of that share unused: more sequences (a busier endpoint) or longer
        drafts mean fewer forks each, a slower target more. Never more than the measured hits repay
        (SsdStats.useful_forks)."""
        if self.stats.verify_s:
            share = elapsed / self.stats.verify_s
            if share > self.PRESPEC_SHARE:
                self.forks = max(1, self.forks - 1)
            elif share < 0.75 * self.PRESPEC_SHARE:
                self.forks = min(self.fork_budget, self.forks + 1)
        self.forks = min(self.forks, self.stats.useful_forks(k_next, self.fork_budget))

    def adopt(self, seq_id: str, drafts: Sequence[int]) -> None:
        """The target verifies drafts of its own next (push mode: a miss it resolved locally)."""
        seq = self._seqs[seq_id]
        if seq.ready is not None:  # we had a hit it did not see in time
            self._unready(seq)
        seq.drafts, seq.fed, seq.rows, seq.source, seq.predicted = list(drafts), 0, [], "fast", []
        seq.handed_out_at = time.monotonic()

    def served_from_cache(self, seq_id: str) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.source == "cache"

    def outcome_table(self, seq_id: str) -> dict[Outcome, Fork]:
        """The cache entries for a sequence's outstanding drafts (what push mode streams out)."""
        seq = self._seqs.get(seq_id)
        return dict(seq.forks) if seq is not None else {}

    # -- internals ------------------------------------------------------------------------------------

    def choose_backup(self) -> str:
        """Neural (draft now) or fast (n-gram), as set, or from the measured figures (auto)."""
        return self.backup_mode if self.backup_mode != "auto" else self.stats.best_backup()

    def fast_backup(self) -> bool:
        return self.choose_backup() == "fast"

    def _candidates(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.topk(logits, min(self.CANDIDATES, logits.shape[-1]), dim=-1).indices

    def _sample(self, logits: torch.Tensor, params: SamplingParams):
        """[N, V] logits -> (tokens [N], q ids [N, k] | None, q probs [N, k] | None)."""
        if params.greedy:
            return logits.argmax(-1), None, None
        q = logits_to_probs(logits, params)
        if self.saguaro_c < 1.0:
            top = torch.topk(q, min(self.forks, q.shape[-1]), dim=-1).indices
            q = q.scatter(-1, top, q.gather(-1, top) * self.saguaro_c)
        return sample_top_k(q, min(self.q_top_k, q.shape[-1]), self.generator)

    def _draft_neural(self, seq_ids: list[str], nums: list[int], params: SamplingParams) -> None:
        """Drafts now, with the draft model's loop: candidate ids of each row kept, q sampled as in the forks."""
        seqs = [self._seqs[s] for s in seq_ids]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        q_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in seqs]

        def pick(j: int, active: list[int], logits: torch.Tensor) -> torch.Tensor:
            cands = self._candidates(logits)
            picked, ids, probs = self._sample(logits, params)
            for i, b in enumerate(active):
                rows[b].append(cands[i])
                if ids is not None:
                    q_rows[b].append((ids[i], probs[i]))
            return picked

        feeds, features = zip(*(self.feed.take(self.cache, s) for s in seqs))
        drafts, predicted = draft_steps(self.feed, self.cache, [s.slot for s in seqs], feeds, features, nums, pick)
        for s, n, drafted, cands, q, p in zip(seqs, nums, drafts, rows, q_rows, predicted):
            s.drafts, s.fed, s.rows, s.source, s.predicted = drafted, n - 1, cands, "neural", p
            s.q = _stacked(q)

    def _glue(self, seqs: list[_Seq]) -> None:
        """Feed every sequence's unfed tokens (pending context, then drafts) so its cache holds
        context + d1..dK, and keep candidate ids (and a head's predicted feature) for each draft row it
        had none for. One forward, but a head's drafts with no predicted features (n-gram or adopted)
        go one position a step after it, each with the feature predicted at the one before.

        Example (a draft model): a sequence started with context [5, 6, 7] (all pending) then adopted
        the drafts [8, 9] (fed 0). One forward feeds [5, 6, 7, 8, 9]: the cache then holds those 5
        positions, s.pending == [], s.fed == 2, and s.rows gets 3 rows of candidate ids, the top
        CANDIDATES tokens after 7, after 8 and after 9 (rows[k]: after context + d1..dk, k = 0..K).
        """
        seqs = [s for s in seqs if s.pending or s.fed < len(s.drafts)]  # glued already: nothing to feed
        if not seqs:
            return
        # Drafts whose inputs are known (a head's: those it has a predicted feature for) go in the first forward.
        ends = [self.feed.known(s.drafts, s.predicted) for s in seqs]
        feeds, features = [], []
        for s, end in zip(seqs, ends):
            known = s.fed + 1 - bool(s.pending)  # the first row this feed yields (row 0 after pending context)
            tokens, true = self.feed.take(self.cache, s)
            feeds.append(tokens + list(s.drafts[s.fed : end]))
            features.append(self.feed.row_features(true, s.predicted[s.fed : end]))
            s.rows, s.predicted, s.fed = s.rows[:known], s.predicted[:known], end
        logits, hidden = self.feed.forward(self.cache, [s.slot for s in seqs], feeds, features, all_logits=True)
        for b, s in enumerate(seqs):
            # Rows known..end are the last positions of this row's feed.
            n, first = len(feeds[b]), len(feeds[b]) - (s.fed + 1 - len(s.rows))
            s.rows += list(self._candidates(logits[b, first:n]))
            s.predicted += list(hidden[b, first:n])
        while rest := [s for s in seqs if s.fed < len(s.drafts)]:
            logits, hidden = self.feed.forward(self.cache, [s.slot for s in rest], [[s.drafts[s.fed]] for s in rest],
                                               [s.predicted[s.fed][None] for s in rest])
            for s, row, p in zip(rest, self._candidates(logits), hidden[:, 0]):
                s.rows.append(row)
                s.predicted.append(p)
                s.fed += 1

    def _tree_decode(self, forks: list[tuple[_Seq, Outcome, int]], k_next: int) -> None:
        """Each fork (a copy of its sequence's prefix, then its bonus) drafts k_next tokens, with the
        draft model's loop over every fork of every sequence, each sampled as its sequence asks. A head
        feeds the bonus of (k, b) with the feature it predicted after d_k."""
        built, features = [], []
        for seq, (k, bonus), prefix in forks:
            if (k, bonus) in seq.forks:  # pre-speculated again for the same drafts: its old fork's slot goes back
                self.cache.release(seq.forks[(k, bonus)].slot)
            fork = seq.forks[(k, bonus)] = Fork(self.cache.fork(seq.slot, prefix), bonus, [], [], None, None)
            built.append((seq, fork))
            features.append(seq.predicted[k][None])
        groups = {params: [i for i, (s, _) in enumerate(built) if s.params == params]
                  for params in {s.params for s, _ in built}}
        q_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in built]

        def pick(j: int, active: list[int], logits: torch.Tensor) -> torch.Tensor:
            cands = self._candidates(logits)
            picked = torch.empty(len(active), dtype=torch.long)
            for params, rows in groups.items():
                picked[rows], ids, probs = self._sample(logits[rows], params)
                for r, i in enumerate(rows):
                    built[i][1].rows.append(cands[i])
                    if ids is not None:
                        q_rows[i].append((ids[r], probs[r]))
            return picked

        drafts, predicted = draft_steps(self.feed, self.cache, [f.slot for _, f in built], [[f.bonus] for _, f in built],
                                        features, [k_next] * len(built), pick)
        for (_, fork), drafted, q, p in zip(built, drafts, q_rows, predicted):
            # The last draft was never fed (as after any propose): the cache holds b, d'1..d'_{K-1}.
            fork.drafts, fork.predicted = drafted, p
            fork.topk_ids, fork.topk_probs = _stacked(q) or (None, None)

    def _unready(self, seq: _Seq) -> None:
        """Drops a hit's drafts from the cache as the feed says, and its bonus token too, back to
        pending: keeping the bonus cached left nothing to feed after an outcome with no new tokens, and
        the glue one row short."""
        self.feed.undo_hit(self.cache, seq, seq.ready.bonus, len(seq.ready.drafts) - 1)
        seq.ready = None

    def _drop_forks(self, seq: _Seq) -> None:
        for fork in seq.forks.values():
            self.cache.release(fork.slot)
        seq.forks = {}
        if seq.ready is not None and seq.ready.slot != seq.slot:
            self.cache.release(seq.ready.slot)
            seq.ready = None


def _sparse(tokens, q_ids, q_probs, k: int) -> dict:
    """Sparse q for every row of a sampled group; deterministic (n-gram) rows as one-hot pairs."""
    k_max = max((len(t) for t in tokens), default=0)
    ids = torch.zeros(len(tokens), k_max, k, dtype=torch.long)
    probs = torch.zeros(len(tokens), k_max, k)
    for b, t in enumerate(tokens):
        if not t:
            continue
        if q_ids[b] is not None:
            n = len(t)
            ids[b, :n, : q_ids[b].shape[-1]], probs[b, :n, : q_ids[b].shape[-1]] = q_ids[b], q_probs[b]
        else:
            ids[b, : len(t)] = torch.tensor(t)[:, None]
            probs[b, : len(t), 0] = 1.0
    return {"topk_ids": ids, "topk_probs": probs}


def _stacked(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-draft (ids [k], probs [k]) -> (ids [K, k], probs [K, k]); None when greedy (no rows)."""
    if not rows:
        return None
    ids, probs = zip(*rows)
    return torch.stack(ids), torch.stack(probs)


def build(sources, backup: Drafter | None = None) -> SsdDrafter | None:
    """The registry's SSD drafter (drafters/registry.py): on the head where there is one (its forks grow
    from the head's predicted features), else on the draft model; `backup` (the drafter of its method
    row's backup, n-gram) is the fast one a miss may fall back to. SSD sequences hold forks too, so they get a cache of their own: a sequence
    holds up to max_len tokens, pre-speculation feeds its drafts on top, and a fork a bonus token and
    its own drafts (without that room, a sequence near max_len failed the pre-speculation of every SSD
    sequence in its step)."""
    model = sources.head or sources.draft
    if model is None:
        return None
    options = {"max_sequences": 16, "fork_slots": 128} | dict(sources.ssd)
    return SsdDrafter(model, max_len=sources.max_len + 2 * MAX_DRAFT_TOKENS + 1,
                      fast=backup, **options)
