"""The sampled distribution written from the definitions in plain numpy (float64), independent of the
engine's torch code: the reference the engine's sampler and every TV test's exact distribution are
checked against (`checked_probs`).

The four cuts compose in the engine's documented order (engine/verification/sampling.py):

1. temperature T > 0: p = softmax(logits / T); T = 0 is greedy: all mass on the largest logit (the
   first, lowest id, among tied maxima);
2. top-k (k > 0): keep the tokens whose logit is >= the k-th largest logit, so every token tied with
   the k-th stays (more than k then);
3. top-p (p < 1): renormalise what top-k kept, order it by probability, highest first, ties by lower
   token id; keep the shortest prefix whose cumulative probability is >= top_p, the token that
   crosses top_p included (each token whose mass before it is < top_p);
4. min-p (m > 0): keep the tokens with p >= m * p_max. p / p_max is the same before and after
   renormalising, and every cut keeps the most probable token, so min-p keeps the same tokens
   whichever distribution it reads; top-p, before it, reads the distribution without min-p.

The result is the tempered distribution restricted to the kept tokens and renormalised.
"""

from __future__ import annotations

import numpy as np


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """[..., V] logits -> [..., V] float64 probabilities, one row at a time."""
    rows = np.asarray(logits, dtype=np.float64)
    flat = rows.reshape(-1, rows.shape[-1])
    out = np.stack([_row(r, temperature, top_k, top_p, min_p) for r in flat])
    return out.reshape(rows.shape)


def _row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    vocab = logits.size
    if temperature <= 0:
        greedy = np.zeros(vocab)
        greedy[np.argmax(logits)] = 1.0  # argmax returns the first of tied maxima
        return greedy
    with np.errstate(over="ignore"):  # a tiny T: every token below the maximum goes to -inf
        scaled = (logits - logits.max()) / temperature  # softmax(logits / T) is exp(scaled), normalised
    weights = np.exp(scaled)
    keep = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        kth_largest = np.sort(scaled)[vocab - top_k]
        keep &= scaled >= kth_largest
    if top_p < 1.0:
        probs = np.where(keep, weights, 0.0) / weights[keep].sum()
        order = np.argsort(-probs, kind="stable")  # stable: tied tokens in id order
        mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        nucleus = np.zeros(vocab, dtype=bool)
        nucleus[order[mass_before < top_p]] = True
        keep &= nucleus
    if min_p > 0.0:
        probs = np.where(keep, weights, 0.0) / weights[keep].sum()
        keep &= probs >= min_p * probs.max()
    kept = np.where(keep, weights, 0.0)
    return kept / kept.sum()


# A token the reference keeps with less mass than this may underflow to 0 in the engine's float32.
UNDERFLOW = 1e-30


def assert_matches_reference(engine_probs, logits, params) -> None:
    """The engine's [..., V] distribution for these logits under params (a SamplingParams) equals the
    reference's: the same tokens kept, whatever their mass (a cut one token off shows even where that
    token is nearly improbable), and the same probabilities within float32 rounding."""
    ref = reference_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    got = np.asarray(engine_probs, dtype=np.float64)
    extra, missing = (got > 0) & (ref == 0), (got == 0) & (ref > UNDERFLOW)
    assert not (extra.any() or missing.any()), (
        f"{params}: the engine keeps tokens the reference cuts at {np.argwhere(extra).tolist()[:5]}, "
        f"cuts tokens it keeps at {np.argwhere(missing).tolist()[:5]} ([row.., token])")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7, err_msg=str(params))
