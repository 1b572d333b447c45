"""specpool: disaggregated speculative decoding."""

from specpool.engine.runtime import process_env

process_env.apply()  # before anything imports torch: libgomp and oneDNN read these when it loads
