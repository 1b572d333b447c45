"""Benchmarks. `python -m bench.<module>` runs without the specpool package first, so the process
settings torch reads at load time are applied here, as `specpool` does."""

from specpool.engine.runtime import process_env

process_env.apply()
