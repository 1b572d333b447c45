"""The speculation policy: how many tokens to speculate per sequence: SSSD's hardware-aware budget, from measured costs.

A verify step of b sequences with s drafts each costs T(b, s), measured once per model, dtype and
thread count (a few seconds) and cached. A step yields E(s) tokens per sequence: measured per
draft position from recent rounds (AcceptanceEstimate), or, with one per-token acceptance alpha,
(1 - alpha^(s+1)) / (1 - alpha). The policy picks the s that maximises
b * E(s) / (T(b, s) + D(b, s)), D being the drafting time (zero for n-gram lookups), and s = 0
(plain decoding) when no s beats it. As the batch grows the target turns compute-bound, T grows
with s, and the budget shrinks, as in SSSD (s ~ I_knee / b). What real rounds take beyond the table
(RoundSlowdown, told by the decoder after each round) scales both sides of that comparison.

costs.py measures and caches T; acceptance.py estimates E; draft_length.py chooses s per round
(SpeculationPolicy, and the hybrid drafter's HybridDraftLength).
"""
