"""Shared fixtures: one persistent gloo pool per world size for the whole session.

A pool call that outlives its timeout fails as a hang. The timeout scales with the machine's
load; set ``COMPILED_LOGPROB_TEST_TIMEOUT`` (seconds) to fix it instead, e.g. on a shared
runner (see :mod:`compiled_logprob.testing.multiprocess`).
"""

from __future__ import annotations

import pytest

from compiled_logprob.testing.multiprocess import GlooPool


@pytest.fixture(scope="session")
def gloo_pool():
    """``gloo_pool(world_size)`` -> a :class:`GlooPool`, started once and reused by every test."""
    pools: dict[int, GlooPool] = {}

    def get(world_size: int) -> GlooPool:
        if world_size not in pools:
            pools[world_size] = GlooPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
