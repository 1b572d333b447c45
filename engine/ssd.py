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
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from specpool.engine.drafter import Drafts
from specpool.engine.model import Llama
from specpool.engine.ngram import NgramDrafter
from specpool.engine.sampling import SamplingParams, logits_to_probs, sample

Outcome = tuple[int, int]  # (accepted drafts k, bonus token b)


@dataclass
class SsdStats:
    """Measured online; they drive the fan-out and the backup choice, and feed the metrics."""

    lookups: int = 0
    hits: int = 0
    bonus_top1: int = 0  # outcomes whose bonus was the first candidate of its row
    accepted_on_hit: int = 0  # drafts accepted in rounds that were served from the cache
    rounds_on_hit: int = 0
    accepted_on_miss: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    rounds_on_miss: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    backups: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    # rank of the real bonus among its row's candidates (0 = first); misses beyond the list at the end
    bonus_ranks: list[int] = field(default_factory=lambda: [0] * 33)
    accept_ema: float = 0.5  # per-token acceptance a
    prespec_s: float = 0.0  # EMA seconds of one pre-speculation pass
    neural_s: float = 0.0  # EMA seconds of one neural backup draft
    verify_s: float = 0.0  # EMA seconds between handing out drafts and the arrival of their outcome

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def p_hit(self, fanout: int) -> float:
        total = sum(self.bonus_ranks)
        return sum(self.bonus_ranks[:fanout]) / total if total else 0.5

    def miss_exponent(self) -> float:
        """r in 1 - p_hit(F) = F^-r, least squares on log(1 - p_hit(F)) over F = 2..8."""
        xs, ys = [], []
        for f in range(2, 9):
            miss = 1 - self.p_hit(f)
            if 0 < miss < 1:
                xs.append(math.log(f))
                ys.append(math.log(miss))
        if not xs:
            return 1.0
        r = -sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return min(max(r, 0.05), 5.0)


def ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old == 0.0 else (1 - weight) * old + weight * new


def geometric_fanout(budget: int, k_max: int, a: float, r: float) -> list[int]:
    """Forks per acceptance length k = 0..K: F_k ~ a^(k/(1+r)); the all-accepted term (k = K) scaled by
    (1-a)^(-1/(1+r)), since its probability a^K lacks the (1-a) of a rejection. Sums to `budget`."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    w = [a ** (k / (1 + r)) for k in range(k_max + 1)]
    w[k_max] *= (1 - a) ** (-1 / (1 + r))
    total = sum(w)
    raw = [budget * x / total for x in w]
    fan = [int(x) for x in raw]
    # Largest remainders get the leftover forks.
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - fan[i], reverse=True)[: budget - sum(fan)]:
        fan[i] += 1
    return fan


@dataclass
class _Fork:
    slot: int
    bonus: int  # the outcome's bonus token, its first fed token
    drafts: list[int]
    rows: list[torch.Tensor]  # candidate ids of rows 0..K-1 (row j: after its bonus and d'1..d'j)
    topk_ids: torch.Tensor | None  # [K, k] the sparse q each draft was sampled from
    topk_probs: torch.Tensor | None


@dataclass
class _Seq:
    slot: int
    pending: list[int]  # tokens not yet in the KV cache
    params: SamplingParams = field(default_factory=SamplingParams)
    drafts: list[int] = field(default_factory=list)  # handed out, awaiting their outcome
    fed: int = 0  # of those drafts, how many are in the KV cache
    rows: list[torch.Tensor] = field(default_factory=list)  # candidate ids per draft row known so far
    forks: dict[Outcome, _Fork] = field(default_factory=dict)
    ready: _Fork | None = None  # a hit: the next drafts, already decoded (d'1..d'_{K-1} in the cache)
    q: tuple[torch.Tensor, torch.Tensor] | None = None  # sparse q of neural drafts: ids, probs [K, k]
    source: str = "neural"  # where the outstanding drafts came from: cache, neural, fast
    handed_out_at: float = 0.0


class SsdDrafter:
    """The Drafter (engine.drafter protocol) for SSD, plus `prespeculate` and `outcome_table`."""

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
        ngram: NgramDrafter | None = None,
        backup: str = "auto",  # auto (from measured figures), neural or fast
    ):
        self.model = model
        self.cache = model.new_cache(max_sequences + fork_slots, max_len)
        self.fork_budget = fork_budget  # the most forks per sequence
        self.forks = max(1, fork_budget // 2)  # forks per sequence now (sized by _size_forks)
        self.saguaro_c = saguaro_c
        self.q_top_k = q_top_k
        self.ngram = ngram or NgramDrafter()
        self.backup_mode = backup
        self.stats = SsdStats()
        self.generator = torch.Generator().manual_seed(0)
        self.lookahead = 0  # drafts per fork: what the target asked for last
        self._seqs: dict[str, _Seq] = {}

    # -- Drafter protocol -----------------------------------------------------------------------

    def start(self, seq_id: str, context: Sequence[int]) -> None:
        self._seqs[seq_id] = _Seq(slot=self.cache.allocate(), pending=list(context))
        self.ngram.start(seq_id, context)

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        self.ngram.release(seq_id)
        if seq is not None:
            self._drop_forks(seq)
            self.cache.release(seq.slot)

    def observe(self, seq_id: str, tokens: Sequence[int], arrived_at: float | None = None) -> None:
        """The verification outcome of the outstanding drafts (and anything emitted since), which
        arrived at `arrived_at` (time.monotonic(); default: now)."""
        seq = self._seqs[seq_id]
        self.ngram.observe(seq_id, tokens)
        if seq.ready is not None:  # a hit nobody drafted from
            self._unready(seq)
        drafts = seq.drafts
        k = 0
        while k < len(drafts) and k < len(tokens) and tokens[k] == drafts[k]:
            k += 1
        if drafts:
            self._learn(seq, k, tokens)
        fork = seq.forks.pop((k, tokens[k]), None) if seq.forks and len(tokens) == k + 1 else None
        if drafts and seq.handed_out_at:
            arrived = time.monotonic() if arrived_at is None else arrived_at
            self.stats.verify_s = ema(self.stats.verify_s, arrived - seq.handed_out_at)
        if fork is not None:
            # Hit: the fork already holds context + d1..dk + b + its own drafts; it becomes the sequence.
            self._drop_forks(seq)
            self.cache.release(seq.slot)
            seq.slot, seq.ready, seq.pending = fork.slot, fork, []
        else:
            self._drop_forks(seq)
            # As in ModelDrafter.extend, the last token is always fed again: the next forward needs an
            # input (an outcome of accepted drafts only, with no bonus, left nothing to feed).
            keep = min(k, seq.fed, max(len(tokens) - 1, 0))
            self.cache.truncate(seq.slot, self.cache.lengths[seq.slot] - seq.fed + keep)
            seq.pending.extend(tokens[keep:])
            seq.ready = None
        seq.drafts, seq.fed, seq.rows = [], 0, []

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
                seq.drafts, seq.fed, seq.rows = fork.drafts[:n], n - 1, fork.rows[:n]
                # The fork fed d'1..d'_{K-1}; as after any propose, the cache keeps d'1..d'_{n-1}.
                self.cache.truncate(seq.slot, self.cache.lengths[seq.slot] - (len(fork.drafts) - 1) + seq.fed)
                out_tokens[b] = list(seq.drafts)
                if sampled:
                    q_ids[b], q_probs[b] = fork.topk_ids[:n], fork.topk_probs[:n]
                seq.source, seq.ready = "cache", None
            elif self.choose_backup() == "fast":
                seq.ready = None
                seq.drafts, seq.fed, seq.rows, seq.source = self.ngram.draft(sid, n), 0, [], "fast"
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
                    if self.cache.free_slots == 0:
                        break
                    forks.append((seq, (k, b), base + k))
        if forks:
            self._tree_decode(forks, k_next)
        elapsed = time.monotonic() - start
        self.stats.prespec_s = ema(self.stats.prespec_s, elapsed)
        self._size_forks(elapsed)

    def _has_room(self, seq: _Seq, k_next: int) -> bool:
        """Whether the cache holds this sequence glued (context + d1..dK) plus a fork's bonus and
        drafts: near the end of the cache, a sequence is drafted on demand instead of pre-speculated."""
        glued = self.cache.lengths[seq.slot] + len(seq.pending) + len(seq.drafts) - seq.fed
        return glued + k_next <= self.cache.max_len

    def _size_forks(self, elapsed: float) -> None:
        """One fork per sequence fewer when a pass overran its share of the verify time, one more
        when it left a quarter of that share unused: more sequences (a busier endpoint) or longer
        drafts mean fewer forks each, a slower target more."""
        if not self.stats.verify_s:
            return
        share = elapsed / self.stats.verify_s
        if share > self.PRESPEC_SHARE:
            self.forks = max(1, self.forks - 1)
        elif share < 0.75 * self.PRESPEC_SHARE:
            self.forks = min(self.fork_budget, self.forks + 1)

    def adopt(self, seq_id: str, drafts: Sequence[int]) -> None:
        """The target verifies drafts of its own next (push mode: a miss it resolved locally)."""
        seq = self._seqs[seq_id]
        if seq.ready is not None:  # we had a hit it did not see in time
            self._unready(seq)
        seq.drafts, seq.fed, seq.rows, seq.source = list(drafts), 0, [], "fast"
        seq.handed_out_at = time.monotonic()

    def served_from_cache(self, seq_id: str) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.source == "cache"

    def outcome_table(self, seq_id: str) -> dict[Outcome, _Fork]:
        """The cache entries for a sequence's outstanding drafts (what push mode streams out)."""
        seq = self._seqs.get(seq_id)
        return dict(seq.forks) if seq is not None else {}

    # -- internals ------------------------------------------------------------------------------------

    def _learn(self, seq: _Seq, k: int, tokens: Sequence[int]) -> None:
        """Acceptance, hit and bonus-rank statistics from one outcome."""
        st = self.stats
        K = len(seq.drafts)
        st.accept_ema = ema(st.accept_ema, k / K if k < K else 1.0, 0.1)
        if seq.source == "cache":
            st.accepted_on_hit += k
            st.rounds_on_hit += 1
        else:
            st.accepted_on_miss[seq.source] = st.accepted_on_miss.get(seq.source, 0) + k
            st.rounds_on_miss[seq.source] = st.rounds_on_miss.get(seq.source, 0) + 1
        if len(tokens) <= k or k >= len(seq.rows):
            return
        bonus, banned = tokens[k], seq.drafts[k] if k < K else -1
        ranked = [t for t in seq.rows[k].tolist() if t != banned]
        rank = ranked.index(bonus) if bonus in ranked else len(st.bonus_ranks) - 1
        st.bonus_ranks[min(rank, len(st.bonus_ranks) - 1)] += 1
        st.bonus_top1 += rank == 0
        if seq.forks:
            st.lookups += 1
            st.hits += (k, bonus) in seq.forks and len(tokens) == k + 1

    def choose_backup(self) -> str:
        """Neural (draft now) or fast (n-gram, no drafting time), from the expected-speedup formula
        [p_hit E_hit + (1-p_hit) E_miss] / [p_hit max(1, T_p) + (1-p_hit)(1 + T_b)], times in verify units."""
        if self.backup_mode != "auto":
            return self.backup_mode
        st = self.stats
        if st.verify_s == 0.0 or st.rounds_on_miss.get("fast", 0) < 3:
            # Measure the fast backup a few times before trusting a comparison.
            return "fast" if st.backups["neural"] >= 3 and st.backups["fast"] < 3 else "neural"
        p = st.hit_ratio
        e_hit = 1 + (st.accepted_on_hit / st.rounds_on_hit if st.rounds_on_hit else 1.0)
        t_p = st.prespec_s / st.verify_s

        def speedup(kind: str, t_b: float) -> float:
            rounds = st.rounds_on_miss.get(kind, 0)
            e_miss = 1 + (st.accepted_on_miss.get(kind, 0) / rounds if rounds else 0.0)
            return (p * e_hit + (1 - p) * e_miss) / (p * max(1.0, t_p) + (1 - p) * (1 + t_b))

        return "neural" if speedup("neural", st.neural_s / st.verify_s) >= speedup("fast", 0.0) else "fast"

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
        top = torch.topk(q, min(self.q_top_k, q.shape[-1]), dim=-1)
        weights = top.values / top.values.sum(-1, keepdim=True)
        picked = top.indices.gather(-1, sample(weights, self.generator)[:, None]).squeeze(-1)
        return picked, top.indices, weights

    def _draft_neural(self, seq_ids: list[str], nums: list[int], params: SamplingParams) -> None:
        seqs = [self._seqs[s] for s in seq_ids]
        q_ids: dict[int, list[torch.Tensor]] = {id(s): [] for s in seqs}
        q_probs: dict[int, list[torch.Tensor]] = {id(s): [] for s in seqs}
        for s in seqs:
            s.drafts, s.fed, s.rows, s.source, s.q = [], 0, [], "neural", None
        feed = {id(s): s.pending for s in seqs}
        for j in range(max(nums)):
            active = [s for s, n in zip(seqs, nums) if n > j]
            logits = self.model.forward(self.cache, [s.slot for s in active], [feed[id(s)] for s in active])
            cands = self._candidates(logits)
            picked, ids, probs = self._sample(logits, params)
            for i, s in enumerate(active):
                if j == 0:
                    s.pending = []
                else:
                    s.fed += 1
                s.rows.append(cands[i])
                s.drafts.append(int(picked[i]))
                feed[id(s)] = [int(picked[i])]
                if ids is not None:
                    q_ids[id(s)].append(ids[i])
                    q_probs[id(s)].append(probs[i])
        for s in seqs:
            if q_ids[id(s)]:
                s.q = (torch.stack(q_ids[id(s)]), torch.stack(q_probs[id(s)]))

    def _glue(self, seqs: list[_Seq]) -> None:
        """Feed every sequence's unfed tokens (pending context, then drafts) so its cache holds
        context + d1..dK, and keep candidate ids for each draft row it had none for."""
        feeds = [s.pending + s.drafts[s.fed :] for s in seqs]
        logits = self.model.forward(self.cache, [s.slot for s in seqs], feeds, all_logits=True)  # [B, T, V]
        for b, s in enumerate(seqs):
            K, known = len(s.drafts), len(s.rows)
            # Rows known..K are the last K+1-known positions of this row's feed.
            n = len(feeds[b])
            new = self._candidates(logits[b, n - (K + 1 - known) : n])
            s.rows = s.rows + list(new)
            s.pending, s.fed = [], K

    def _tree_decode(self, forks: list[tuple[_Seq, Outcome, int]], k_next: int) -> None:
        built = []
        for seq, outcome, prefix in forks:
            slot = self.cache.allocate()
            c = self.cache
            c.k[:, slot, :, :prefix] = c.k[:, seq.slot, :, :prefix]
            c.v[:, slot, :, :prefix] = c.v[:, seq.slot, :, :prefix]
            c.lengths[slot] = prefix
            fork = _Fork(slot, outcome[1], [], [], None, None)
            seq.forks[outcome] = fork
            built.append((seq, outcome[1], fork))
        feed = [[b] for _, b, _ in built]
        ids_rows: list[list[torch.Tensor]] = [[] for _ in built]
        prob_rows: list[list[torch.Tensor]] = [[] for _ in built]
        # Group by sampler: every fork of one sequence shares its sampler.
        for j in range(k_next):
            logits = self.model.forward(self.cache, [f.slot for _, _, f in built], feed)
            cands = self._candidates(logits)
            for params in {s.params for s, _, _ in built}:
                rows = [i for i, (s, _, _) in enumerate(built) if s.params == params]
                picked, ids, probs = self._sample(logits[rows], params)
                for r, i in enumerate(rows):
                    fork = built[i][2]
                    fork.drafts.append(int(picked[r]))
                    fork.rows.append(cands[i])
                    feed[i] = [int(picked[r])]
                    if ids is not None:
                        ids_rows[i].append(ids[r])
                        prob_rows[i].append(probs[r])
        for i, (_, _, fork) in enumerate(built):
            # The last draft was never fed (as after any propose): the cache holds b, d'1..d'_{K-1}.
            if ids_rows[i]:
                fork.topk_ids, fork.topk_probs = torch.stack(ids_rows[i]), torch.stack(prob_rows[i])

    def _unready(self, seq: _Seq) -> None:
        """Drops a hit's drafts from the cache, and its bonus token too, back to pending: the next forward
        (drafts, or the glue before pre-speculating) needs a token to feed. Keeping the bonus cached
        left nothing to feed after an outcome with no new tokens, and the glue one row short."""
        self.cache.truncate(seq.slot, self.cache.lengths[seq.slot] - len(seq.ready.drafts))
        seq.pending = [seq.ready.bonus, *seq.pending]
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
