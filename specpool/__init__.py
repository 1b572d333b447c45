"""specpool: disaggregated speculative decoding."""
