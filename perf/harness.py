"""Shared machinery of the ``perf/`` benchmarks: cases, the four measured methods, timing,
peak memory, and the markdown/PNG report.

Methods, measured side by side in one process (one rank per process for TP > 1):

* ``seed``: the eager seed algorithm (``compiled_logprob.testing.reference``), the baseline;
* ``eager``: ``token_logprobs`` called directly (the user does not compile);
* ``compiled``: ``token_logprobs`` under ``torch.compile(fullgraph=True)``;
* ``floor``: what any implementation must at least do: one compiled pass that reads the
  logits once and does the same ``exp2``/sum (forward), plus one compiled elementwise pass
  that writes the gradient (backward). It does no max, no gather and no collective. On the
  CPU its sum takes the sliced form that Inductor's CPU code runs fastest
  (``compiled_logprob._math.kernels.ROW_SLICES``; a plain ``.sum(-1)`` there is latency-bound and
  measured 2.3-3x slower), so that the floor is one, not one slowed by code generation.

A :class:`Case` is one shape/dtype/mode/layout. The layout today is vocab-parallel only
(``tp``); context parallelism plugs in as a ``cp`` field: :func:`make_inputs` would slice
the sequence per CP rank and :func:`_ours` would pass the CP group, while ``tp_worker``
already runs any ``world_size = tp * cp`` grid of ranks.

Shape legend: ``B`` batch, ``S`` sequence, ``V`` full vocabulary, ``V_local`` one shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import peers

from compiled_logprob import token_logprobs
from compiled_logprob._math import kernels
from compiled_logprob.testing.reference import (
    SeedChunkedDistributedLogprob,
    SeedDistributedLogprob,
    vocab_bounds,
)

METHODS = ("seed", "eager", "compiled", "floor")
# bench_peers.py's too: the peers a user would pick instead, and ours with inplace_backward.
PEER_METHODS = peers.METHODS
# Every (dtype, mode, layout) compiles the same Python function once: more than Dynamo's
# default of 8 compiles per code object.
torch._dynamo.config.recompile_limit = 64
PERF_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(PERF_DIR, "results")


def write_result(name: str, device: str, quick: bool, report: str, *, quiet: bool = False) -> str:
    """Write ``report`` to ``results/{name}_{device type}[_quick].md`` and print it (unless
    ``quiet``: a partial report rewritten as a run goes)."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}_{device.split(':')[0]}{'_quick' if quick else ''}.md")
    with open(path, "w") as f:
        f.write(report)
    if not quiet:
        print(report)
        print(f"wrote {path}")
    return path


def case_benchmark(
    argv, *, name: str, title: str, legend: str, measure: Callable, table: Callable,
    seq: int, quick_seq: int, repeats: int,
) -> dict:
    """The command line of the per-case benchmarks (``bench_extras``, ``bench_filtering``):
    ``measure(case, device=, repeats=)`` for ``[2, seq, 32000]`` fp32 and bf16, forward and
    forward+backward, TP = 1, and ``results/{name}_<device>[_quick].md`` (``title``, the
    machine, ``legend``, ``table(results)``) rewritten after every case, so that a run cut
    short (a timeout) leaves what it measured. ``--time-budget``: no new case starts after
    that many seconds; the report names the cases not run."""
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--quick", action="store_true", help=f"[2, {quick_seq}, 32000]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case starts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    length = quick_seq if args.quick else seq
    cases = [Case(2, length, 32000, d, b) for d in ("float32", "bfloat16") for b in (False, True)]

    def write(results: dict, status: str, quiet: bool = False) -> None:
        report = (
            f"# {title}{' (quick)' if args.quick else ''}\n\n{machine_header(args.device)}"
            f"- {status}\n- median of {args.repeats} calls after one warm-up each, interleaved; "
            f"threads: {args.threads}; times in ms\n{legend}\n{table(results)}"
        )
        write_result(name, args.device, args.quick, report, quiet=quiet)

    start = time.monotonic()
    results: dict = {}
    for done, case in enumerate(cases):
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            skipped = ", ".join(c.label() for c in cases[done:])
            write(results, f"cut short by --time-budget {args.time_budget:g} s: not run: {skipped}")
            return results
        results[case] = measure(case, device=args.device, repeats=args.repeats)
        print(f"  {case.label()} done", flush=True)
        last = done + 1 == len(cases)
        write(results, "complete" if last else "partial: in progress, or interrupted", quiet=not last)
    return results


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration: logits ``[batch, seq, vocab]`` split over ``tp`` ranks."""

    batch: int
    seq: int
    vocab: int
    dtype: str  # "float32" | "bfloat16"
    backward: bool  # forward+backward (training) or forward only (inference)
    tp: int = 1
    chunk: int | None = None

    @property
    def mode(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def logits_bytes(self) -> int:
        """Bytes of one rank's logits (= one gradient buffer)."""
        return self.batch * self.seq * self.vocab // self.tp * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        chunk = f" chunk={self.chunk}" if self.chunk else ""
        return f"[{self.batch}, {self.seq}, {self.vocab}] {self.dtype} {self.mode} TP={self.tp}{chunk}"


# ---------------------------------------------------------------------------------------------
# Inputs and the four methods


def make_inputs(case: Case, rank: int, device: str):
    """This rank's logits ``[B, S, V_local]``, global targets ``[B, S]``, an incoming
    gradient ``[B, S]`` and the shard bounds. Targets agree across ranks; logits need not."""
    start, end = vocab_bounds(case.vocab, case.tp, rank)
    shared = torch.Generator(device="cpu").manual_seed(1234)
    target = torch.randint(0, case.vocab, (case.batch, case.seq), generator=shared).to(device)
    grad_out = torch.randn(case.batch, case.seq, generator=shared).to(device)
    # The logits are drawn where they live: on a GPU, gigabytes drawn by a few CPU threads
    # would take longer than the whole measurement.
    own = torch.Generator(device=device).manual_seed(1235 + rank)
    logits = torch.randn(case.batch, case.seq, end - start, generator=own, device=device)
    logits = logits.mul_(3).to(case.torch_dtype)
    for x in (logits, target, grad_out):
        # One compile per (dtype, mode, layout) for every sequence length.
        torch._dynamo.maybe_mark_dynamic(x, 1)
    return logits.requires_grad_(case.backward), target, grad_out, start, end


def _floor_forward(logits):
    return kernels.row_sum(logits.float().exp2())


def _floor_backward(logits, grad_out):
    return (logits.float().exp2() * grad_out.unsqueeze(-1)).to(logits.dtype)


_FLOOR_FWD = torch.compile(_floor_forward, fullgraph=True)
_FLOOR_BWD = torch.compile(_floor_backward, fullgraph=True)


def _ours(case: Case, start: int, group) -> Callable:
    def logprobs(logits, target):
        return token_logprobs(logits, target, vocab_start=start, group=group, chunk_size=case.chunk)

    return logprobs


def _seed(case: Case, start: int, end: int, group) -> Callable:
    inference_only = not case.backward
    if case.chunk:
        return lambda z, t: SeedChunkedDistributedLogprob.apply(
            z, t, start, end, case.chunk, group, inference_only
        )
    return lambda z, t: SeedDistributedLogprob.apply(z, t, start, end, group, inference_only)


def make_step(method: str, case: Case, inputs, group, compiled_cache: dict) -> Callable[[], object]:
    """A zero-argument callable doing ``method`` once on ``inputs`` (forward, or
    forward+backward returning the logits' gradient). ``compiled_cache`` keeps one
    ``torch.compile`` wrapper per (layout, mode) so that sequence lengths share compiles."""
    logits, target, grad_out, start, end = inputs
    if method == "floor":
        if not case.backward:
            return lambda: _FLOOR_FWD(logits.detach())
        return lambda: (_FLOOR_FWD(logits.detach()), _FLOOR_BWD(logits.detach(), grad_out))
    if method == "seed":
        fn = _seed(case, start, end, group)
    elif method == "eager":
        fn = _ours(case, start, group)
    elif method == "compiled":
        key = (case.dtype, case.backward, case.tp, case.chunk, start)
        if key not in compiled_cache:
            compiled_cache[key] = torch.compile(_ours(case, start, group), fullgraph=True)
        fn = compiled_cache[key]
    elif method in PEER_METHODS:
        fn = peers.peer(method, case, start, group, compiled_cache, str(logits.device))
        if method in peers.CONSUMING:  # its own logits, which it overwrites
            logits = logits.detach().clone().requires_grad_(case.backward)
    else:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS + PEER_METHODS}")
    context = peers.context(method)
    if not case.backward:
        def forward():
            with torch.no_grad(), context():
                return fn(logits, target)
        return forward

    def train():
        with context():
            return torch.autograd.grad(fn(logits, target), logits, grad_out)[0]
    return train


# ---------------------------------------------------------------------------------------------
# Timing


def median_interleaved(
    steps: dict, *, device: str, repeats: int, group=None
) -> dict[object, float]:
    """Median seconds per call of each of ``steps`` (``{key: step()}``), after one warm-up
    call each, timed call by call in turn (interleaved, so that machine noise hits them
    alike); with a ``group``, its ranks start each call together."""
    times: dict[object, list[float]] = {key: [] for key in steps}
    for step in steps.values():
        step()  # warm-up: compile, allocator, caches
    for _ in range(repeats):
        for key, step in steps.items():
            if group is not None:
                dist.barrier(group)
            sync(device)
            start = time.perf_counter()
            out = step()
            sync(device)
            times[key].append(time.perf_counter() - start)
            del out
    return {key: statistics.median(ts) for key, ts in times.items()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_case(
    case: Case, *, device: str, repeats: int, methods=METHODS, rank: int = 0, group=None,
    compiled_cache: dict | None = None,
) -> dict[str, float]:
    """Median seconds per call of each method, after one warm-up call each. The methods are
    interleaved repeat by repeat so that machine noise hits them alike."""
    compiled_cache = {} if compiled_cache is None else compiled_cache
    inputs = make_inputs(case, rank, device)
    steps = {m: make_step(m, case, inputs, group, compiled_cache) for m in methods}
    medians = median_interleaved(steps, device=device, repeats=repeats, group=group)
    del steps, inputs
    gc.collect()
    return medians


def tp_worker(cases: list[dict], repeats: int, methods=METHODS) -> list[dict[str, float]]:
    """Runs on every rank of a :class:`GlooPool`; returns this rank's medians per case."""
    torch.manual_seed(0)
    compiled_cache: dict = {}
    return [
        time_case(
            Case(**c), device="cpu", repeats=repeats, methods=methods, rank=dist.get_rank(),
            group=dist.group.WORLD, compiled_cache=compiled_cache,
        )
        for c in cases
    ]


# ---------------------------------------------------------------------------------------------
# Profiles

# Profiler events that only wrap others.
_WRAPPERS = (
    "## ", "Torch-Compiled Region", "TorchDynamo", "AOTDispatcher", "Pregraph", "CompiledFunction",
    "autograd::", "cudaDeviceSynchronize",
)


def kernel_times(step: Callable[[], object], *, device: str, calls: int) -> list[tuple[float, str, int]]:
    """``(own microseconds, name, count)`` over ``calls`` calls of ``step`` (after one
    warm-up) of every kernel it runs, largest first: own device time of each kernel on a
    GPU; on the CPU, own time of each ATen op and Inductor kernel (with
    ``cpp.enable_kernel_profile``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        sync(device)
    spent = []
    for event in prof.key_averages():
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0 and not event.key.startswith(_WRAPPERS):
            spent.append((own, event.key, event.count))
    return sorted(spent, reverse=True)


# ---------------------------------------------------------------------------------------------
# Peak memory: one fresh process per (method, dtype, mode, chunk) sweeps the sequence lengths,
# resetting the peak before each measured call.


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_extra_bytes(case: Case, method: str, device: str, compiled_cache: dict) -> int:
    """Peak memory of one call above the warmed-up baseline (inputs allocated, compiled,
    run once). CPU: VmHWM over VmRSS; CUDA: max_memory_allocated over memory_allocated."""
    inputs = make_inputs(case, 0, device)
    step = make_step(method, case, inputs, None, compiled_cache)
    step()
    gc.collect()
    if device.startswith("cuda"):
        return cuda_peak_bytes(step)
    reset_peak_rss()
    base = rss_kib("VmRSS")
    out = step()
    peak = rss_kib("VmHWM")
    del out
    return (peak - base) * 1024


def cuda_peak_bytes(step: Callable[[], object]) -> int:
    """The allocator's peak during one call of ``step`` (warmed up) over the memory
    allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def memory_sweep(cases: list[dict], method: str, device: str) -> list[int]:
    compiled_cache: dict = {}
    return [peak_extra_bytes(Case(**c), method, device, compiled_cache) for c in cases]


def memory_in_fresh_process(cases: list[Case], method: str, device: str, threads: int) -> list[int]:
    """:func:`memory_sweep` in a new interpreter (max RSS is per process)."""
    payload = json.dumps({"cases": [dataclasses.asdict(c) for c in cases], "method": method,
                          "device": device, "threads": threads})
    # A fixed mmap threshold stops glibc from keeping freed large buffers resident (its
    # dynamic threshold would let the measured call reuse the warm-up's pages unseen).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "memory", payload],
        check=True, capture_output=True, text=True, env=env,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Report


def machine_header(device: str) -> str:
    if device.startswith("cuda"):
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{platform.processor() or platform.machine()}, {_cpu_model()}, {os.cpu_count()} cores"
    load = f", load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    return (
        f"- machine: {machine}{load}\n- torch {torch.__version__}, Python {platform.python_version()}\n"
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def short_error(error: BaseException) -> str:
    """One line for a report: the error's type and its first two lines (Dynamo's first ends
    in "raised:" and the cause follows)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' '.join(lines[:2])[:160]}"


def fmt_time(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_mib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**20:.0f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__" and sys.argv[1:2] == ["memory"]:
    spec = json.loads(sys.argv[2])
    torch.set_num_threads(spec["threads"])
    print(json.dumps(memory_sweep(spec["cases"], spec["method"], spec["device"])))
