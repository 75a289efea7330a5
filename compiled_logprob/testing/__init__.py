"""Oracles, the seed algorithm and a gloo process pool, shared by tests and benchmarks."""
