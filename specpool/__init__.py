"""specpool: disaggregated speculative decoding."""

from engine import process_env

process_env.apply()  # before anything imports torch: libgomp and oneDNN read these when it loads
