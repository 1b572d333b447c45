"""specpool: disaggregated speculative decoding."""

from specpool.engine import process_env

process_env.apply()  # before anything imports torch: libgomp and oneDNN read these when it loads
