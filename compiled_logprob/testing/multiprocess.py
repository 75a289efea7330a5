"""A pool of CPU gloo processes that stays up between calls.

Spawning a process and importing torch costs seconds, so tests and benchmarks keep one pool
per world size and send it work::

    with GlooPool(world_size=2) as pool:
        results = pool.run(fn, arg)   # fn(arg) on every rank; a list indexed by rank

``fn`` must be importable by name (a module-level function). Inside it,
``torch.distributed`` is initialised on gloo; ``torch.distributed.get_rank()`` tells the rank.
A failure on any rank raises :class:`WorkerError` carrying every failing rank's traceback;
a hang (a collective some rank never joined) raises after a timeout and restarts the pool.

The timeout of a call is, in this order:

* ``GlooPool(..., timeout=seconds)``, when given;
* else the environment variable ``COMPILED_LOGPROB_TEST_TIMEOUT`` (seconds), e.g. to give a
  slow or shared machine more time, or a hung CI job less;
* else 300 s scaled by the machine's load: ``300 * max(1, load / cpu_count)``, ``load`` the
  1-minute load average, re-read while the call waits (a machine that gets busier mid-call
  extends it), capped at 8 times. Compiles slow down in proportion when other jobs share the
  cores, which a fixed timeout reported as hangs; a real hang still fails, after 40 minutes
  at most (a rank blocked in a collective adds no load).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["GlooPool", "WorkerError", "default_timeout", "property_in_lockstep"]

TIMEOUT_ENV = "COMPILED_LOGPROB_TEST_TIMEOUT"
BASE_TIMEOUT = 300.0  # seconds, on an idle machine
MAX_LOAD_FACTOR = 8.0  # a hang still fails, in BASE_TIMEOUT * MAX_LOAD_FACTOR at most


def load_factor() -> float:
    """``max(1, load / cpu_count)`` (at most :data:`MAX_LOAD_FACTOR`): how much slower than
    idle this machine runs now; 1 where the load average is unavailable."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return 1.0
    return min(MAX_LOAD_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def default_timeout(base: float = BASE_TIMEOUT) -> float:
    """Seconds to wait for work that takes ``base`` seconds at most on an idle machine:
    ``$COMPILED_LOGPROB_TEST_TIMEOUT`` when set, else ``base`` times :func:`load_factor`."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return base * load_factor()
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(
            f"{TIMEOUT_ENV}={value!r} must be a positive number of seconds, e.g. "
            f"{TIMEOUT_ENV}=1200; unset it to scale {base:.0f} s with the machine's load"
        )
    return seconds


class WorkerError(RuntimeError):
    """A function sent to the pool raised (or hung) on at least one rank."""


def _worker(rank: int, world_size: int, store_path: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
    # No destroy_process_group(): it synchronises the ranks, and exiting frees it all anyway.


class GlooPool:
    """``world_size`` spawned processes with ``torch.distributed`` initialised on gloo.

    ``timeout``: seconds a call may take before it counts as a hang; ``None`` (the default)
    reads it from the environment or scales it with the machine's load (see the module).
    """

    def __init__(self, world_size: int, *, timeout: float | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        self.world_size = world_size
        self.timeout = timeout
        self._processes: list[BaseProcess] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store_dir = tempfile.TemporaryDirectory(prefix="compiled_logprob_gloo_")
        store_path = os.path.join(self._store_dir.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._processes = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, store_path, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        name = getattr(fn, "__name__", repr(fn))
        outcomes: dict[int, tuple[bool, Any]] = {}
        scaled = self.timeout is None and not os.environ.get(TIMEOUT_ENV, "").strip()
        timeout = self.timeout if self.timeout is not None else default_timeout()
        start = time.monotonic()
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                if scaled:  # the load may have risen since the call started
                    timeout = max(timeout, default_timeout())
                dead = [r for r, p in enumerate(self._processes) if p.exitcode is not None]
                if dead or time.monotonic() - start > timeout:
                    missing = sorted(set(range(self.world_size)) - set(outcomes))
                    self._restart()
                    why = f"ranks {dead} died" if dead else self._timeout_message(timeout)
                    raise WorkerError(f"{name}: {why} (ranks {missing} did not report)") from None
                continue
            outcomes[rank] = (ok, value)
            if not ok:
                # The other ranks may now wait forever in a collective: give them a
                # moment to report, then restart.
                self._drain(outcomes, timeout=5.0)
                break
        failures = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
        if failures:
            if len(outcomes) < self.world_size:
                self._restart()
            details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
            raise WorkerError(f"{name} failed:\n{details}")
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _timeout_message(self, timeout: float) -> str:
        if self.timeout is not None:
            source = "the pool's timeout"
        elif os.environ.get(TIMEOUT_ENV, "").strip():
            source = f"${TIMEOUT_ENV}"
        else:
            source = f"{BASE_TIMEOUT:.0f} s scaled by the load; set {TIMEOUT_ENV} to allow more"
        return f"no result within {timeout:.0f} s ({source})"

    def _drain(self, outcomes: dict[int, tuple[bool, Any]], timeout: float) -> None:
        try:
            while len(outcomes) < self.world_size:
                rank, ok, value = self._results.get(timeout=timeout)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            pass

    def _restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for tasks in self._tasks:
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=10 if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = []
        self._store_dir.cleanup()

    def __enter__(self) -> GlooPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def property_in_lockstep(strategy, check: Callable[[Any], None], *, max_examples: int) -> None:
    """Run the Hypothesis property ``check(example)`` over ``strategy`` on every rank of the
    initialised world in lockstep (call it on every rank, e.g. from a :class:`GlooPool` task).

    Rank 0 alone runs Hypothesis (derandomised, no database, no deadline) and broadcasts
    each example it draws; every rank checks it, and a failure on any rank fails that
    example for Hypothesis, with every failing rank's message. So the ranks' collectives
    stay matched whatever Hypothesis decides on its own: it draws 5% of its numbers from
    constants found in the process's loaded local modules (Inductor's generated kernels
    among them, which differ between ranks), and stops shrinking on wall-clock limits.
    """
    import torch.distributed as dist
    from hypothesis import HealthCheck, given, settings

    def check_everywhere(drawn) -> list[str]:
        try:
            check(drawn)
            failure = ""
        except Exception as error:  # noqa: BLE001 - reported by rank 0, for every rank
            failure = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
        failures: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        return [f for f in failures if f]

    def follow() -> None:  # ranks other than 0: check what rank 0 draws until it is done
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0)
            done, payload = message[0]
            if done:
                if payload:
                    raise AssertionError(f"the property failed (rank 0 reports):\n{payload}")
                return
            check_everywhere(payload)

    if dist.get_rank() != 0:
        follow()
        return

    def example(drawn) -> None:
        dist.broadcast_object_list([(False, drawn)], src=0)
        failures = check_everywhere(drawn)
        if failures:
            raise AssertionError("\n".join(failures))

    lockstep = settings(
        derandomize=True,
        database=None,
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    outcome = ""
    try:
        lockstep(given(strategy)(example))()
    except BaseException as error:
        outcome = f"{type(error).__name__}: {error}"
        raise
    finally:
        dist.broadcast_object_list([(True, outcome)], src=0)
