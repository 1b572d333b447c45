"""specpool: disaggregated speculative decoding."""

import os

# libgomp reads this when torch loads it, so it is set before anything imports torch. Its default
# spin (300k rounds) keeps an idle process's OpenMP threads busy long after their last op, eating the
# turn of the other server on the same cores (a target verifying while its endpoint idles, and back):
# sd-remote ran at 76-78% of in-process sd with the default or OMP_WAIT_POLICY=PASSIVE (which sleeps
# between every two ops of a forward), 96-100% with a short spin (HumanEval 4, K=2, 2 cores).
# In-process modes measured the same either way. An operator's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
