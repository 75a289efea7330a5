"""The gloo pool's timeout: configurable, scaled with the machine's load, and a hang still fails."""

from __future__ import annotations

import time

import pytest

from compiled_logprob.testing import multiprocess
from compiled_logprob.testing.multiprocess import GlooPool, WorkerError, default_timeout


@pytest.fixture
def load(monkeypatch):
    """``load(one_minute_average, cpus)`` fakes the machine the timeout is scaled to."""
    monkeypatch.delenv(multiprocess.TIMEOUT_ENV, raising=False)

    def set_load(average: float, cpus: int) -> None:
        monkeypatch.setattr(multiprocess.os, "getloadavg", lambda: (average, average, average))
        monkeypatch.setattr(multiprocess.os, "cpu_count", lambda: cpus)

    return set_load


@pytest.mark.parametrize(
    "average, cpus, expected",
    [(0.5, 2, 300.0), (2.0, 2, 300.0), (6.0, 2, 900.0), (1000.0, 2, 300.0 * 8)],
)
def test_default_timeout_scales_with_the_load(load, average, cpus, expected):
    load(average, cpus)
    assert default_timeout() == pytest.approx(expected)
    assert default_timeout(base=10.0) == pytest.approx(expected / 30)


def test_environment_variable_overrides_the_scaled_timeout(load, monkeypatch):
    load(6.0, 2)
    monkeypatch.setenv(multiprocess.TIMEOUT_ENV, "42.5")
    assert default_timeout() == 42.5 and default_timeout(base=1.0) == 42.5


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_bad_environment_timeout_is_refused_with_the_fix(load, monkeypatch, value):
    monkeypatch.setenv(multiprocess.TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        default_timeout()


def test_no_load_average_means_the_base_timeout(load, monkeypatch):
    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(multiprocess.os, "getloadavg", unavailable)
    assert default_timeout() == 300.0


def test_a_hang_fails_after_an_explicit_timeout():
    # time.sleep stands in for a collective some rank never joins.
    with GlooPool(1, timeout=2.0) as pool:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"no result within 2 s \(the pool's timeout\)"):
            pool.run(time.sleep, 600)
        assert time.monotonic() - start < 60
        pool.timeout = None  # the restarted worker imports torch first: more than 2 s
        assert pool.run(abs, -3) == [3]  # the pool restarted and works again


def test_bad_explicit_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        GlooPool(1, timeout=0)
