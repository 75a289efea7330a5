"""Vocab-parallel (TP) log-prob benchmark: seed reference vs our eager and compiled paths vs
the floor, forward and forward+backward, fp32 and bf16, TP = 1 and 2, chunked and not.

    python perf/bench_tp.py            # full run (~15 min on 2 CPU cores)
    python perf/bench_tp.py --quick    # small shapes, a few minutes
    python perf/bench_tp.py --device cuda   # what perf/gpu.sh runs on a GPU

Prints the tables and writes ``perf/results/tp_<device>[_quick].md`` and ``.png`` (time and
peak extra memory vs sequence length). The plot needs matplotlib (``pip install -e
'.[perf]'``); without it the PNG is skipped and the tables are still written. TP = 2 runs on
CPU gloo processes only.

The markdown file is rewritten after every measured case, marked partial until the run
ends, so an interrupted or timed-out run leaves what it measured. ``--time-budget`` stops
starting new cases once that many seconds have passed (the rest are listed as skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import harness
from harness import Case, fmt_mib, fmt_time, markdown_table

from compiled_logprob.testing.multiprocess import GlooPool

BATCH, VOCAB, BIG_VOCAB = 2, 32000, 152064
# Allowance for "O(B*S)" in the forward memory target: 16 fp32 values per row.
ROW_BYTES = 64


def plan(quick: bool, device: str) -> dict[str, list[Case]]:
    """The cases of each section. ``sweep`` feeds the plot (TP = 1, sequence lengths)."""
    dtypes = ("float32", "bfloat16")
    modes = (False, True)
    if device == "cpu":
        seqs = [128, 512] if quick else [512, 1024, 2048, 4096]
        big_seq = 128 if quick else 1024
        big_dtypes = dtypes
    else:
        # A lent GPU has minutes, most of them cold Triton compiles (one per dtype, mode and
        # layout): two sequence lengths, long enough for bandwidth, and the big vocabulary
        # in bf16 only (each new V recompiles).
        seqs = [512, 2048] if quick else [2048, 8192]
        big_seq = 1024 if quick else 4096
        big_dtypes = ("bfloat16",)
    long_seq = seqs[-1]
    chunk = long_seq // 4
    sections = {
        "sweep": [Case(BATCH, s, VOCAB, d, b) for d in dtypes for b in modes for s in seqs],
        "big_vocab": [Case(1, big_seq, BIG_VOCAB, d, b) for d in big_dtypes for b in modes],
        "chunked": [Case(BATCH, long_seq, VOCAB, "float32", b, chunk=chunk) for b in modes],
        "tp2": [Case(BATCH, long_seq, VOCAB, d, b, tp=2) for d in dtypes for b in modes]
        + [Case(BATCH, long_seq, VOCAB, "float32", True, tp=2, chunk=chunk)],
        # Memory only (eager and seed): the chunked forward over every sequence length.
        "chunk_sweep": [Case(BATCH, s, VOCAB, "float32", False, chunk=chunk) for s in seqs],
    }
    if device != "cpu":
        del sections["tp2"]  # gloo TP runs on CPU processes; one GPU here
    return sections


TIMED = ("sweep", "big_vocab", "chunked", "tp2")
MEASURED = ("sweep", "big_vocab", "chunked")  # peak memory, every method
CHUNK_SWEEP_METHODS = ("eager", "seed")


class Run:
    """What has been measured so far. ``deadline`` (``time.monotonic()`` seconds) stops new
    cases; ``save`` (set by :func:`main`) rewrites the report after every step."""

    def __init__(self, deadline: float | None = None) -> None:
        self.results: dict[Case, dict[str, float]] = {}
        self.memory: dict[tuple[Case, str], int] = {}
        self.skipped: list[str] = []
        self.deadline = deadline
        self.save = lambda: None

    def out_of_time(self, what: str) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.skipped.append(what)
            print(f"  out of time budget: skipped {what}", flush=True)
            return True
        return False


def _print_times(case: Case, times: dict[str, float]) -> None:
    print(f"  {case.label()}: " + ", ".join(f"{m} {fmt_time(t)} ms" for m, t in times.items()), flush=True)


def run_timings(sections, run: Run, *, device: str, repeats: int, memory_in_process: bool) -> None:
    """Times every case into ``run.results``. With ``memory_in_process`` (CUDA, where the
    allocator's peak resets exactly in process) each case's peak memory per method is
    measured right after its timing, on the same compiled functions; CPU measures it
    later, in fresh processes (:func:`run_memory`)."""
    compiled_cache: dict = {}
    for name in TIMED:
        if name == "tp2":
            continue
        for case in sections.get(name, []):
            if run.out_of_time(f"time{' and memory' if memory_in_process else ''} of {case.label()}"):
                continue
            run.results[case] = harness.time_case(
                case, device=device, repeats=repeats, compiled_cache=compiled_cache
            )
            _print_times(case, run.results[case])
            if memory_in_process:
                for method in harness.METHODS:
                    run.memory[(case, method)] = harness.peak_extra_bytes(case, method, device, compiled_cache)
            run.save()
    if memory_in_process:
        for case in sections["chunk_sweep"]:
            if run.out_of_time(f"memory of {case.label()}"):
                continue
            for method in CHUNK_SWEEP_METHODS:
                run.memory[(case, method)] = harness.peak_extra_bytes(case, method, device, compiled_cache)
        run.save()
    tp_cases = sections.get("tp2", [])
    if tp_cases and not run.out_of_time(f"TP=2 timings ({len(tp_cases)} cases)"):
        with GlooPool(world_size=2, timeout=1800) as pool:
            per_rank = pool.run(harness.tp_worker, [c.__dict__ for c in tp_cases], repeats)
        for i, case in enumerate(tp_cases):
            # A TP step is as slow as its slowest rank.
            run.results[case] = {m: max(rank[i][m] for rank in per_rank) for m in harness.METHODS}
            _print_times(case, run.results[case])
        run.save()


def run_memory(sections, run: Run, *, device: str, threads: int) -> None:
    """CPU: peak extra bytes per (case, method), one fresh process per method and
    (dtype, mode, chunk) group, since max RSS is per process."""
    groups: dict[tuple, list[Case]] = {}
    for name in MEASURED:
        for case in sections[name]:
            groups.setdefault((case.dtype, case.backward, case.chunk), []).append(case)
    groups[("float32", False, "chunk-sweep")] = sections["chunk_sweep"]
    for key, cases in groups.items():
        if run.out_of_time(f"memory {key}"):
            continue
        for method in harness.METHODS:
            if key[2] == "chunk-sweep" and method not in CHUNK_SWEEP_METHODS:
                continue
            measured = harness.memory_in_fresh_process(cases, method, device, threads)
            for case, nbytes in zip(cases, measured):
                run.memory[(case, method)] = nbytes
        print(f"  memory {key}: done", flush=True)
        run.save()


# Achieved bandwidth is quoted against this peak on CUDA (H200 HBM3e).
PEAK_BYTES_PER_S = 4.8e12


def time_table(results, device: str) -> str:
    header = ["case", "seed ms", "eager ms", "compiled ms", "floor ms",
              "eager speed-up", "compiled speed-up", "compiled / floor", "compiled GB/s"]
    rows = []
    for case, t in results.items():
        # Minimum traffic: read the logits (forward); read them again and write the gradient.
        gbps = case.logits_bytes * (3 if case.backward else 1) / t["compiled"] / 1e9
        peak = f" ({gbps * 1e9 / PEAK_BYTES_PER_S:.0%})" if device.startswith("cuda") else ""
        rows.append([
            case.label(), *(fmt_time(t[m]) for m in harness.METHODS),
            f"{t['seed'] / t['eager']:.1f}×", f"{t['seed'] / t['compiled']:.1f}×",
            f"{t['compiled'] / t['floor']:.2f}×", f"{gbps:.1f}{peak}",
        ])
    return markdown_table(header, rows)


def memory_table(memory, cases) -> str:
    header = ["case", "logits MiB", "seed MiB", "eager MiB", "compiled MiB", "floor MiB",
              "eager / logits", "compiled / logits"]
    rows = []
    for case in cases:
        m = {k: memory.get((case, k)) for k in harness.METHODS}
        rows.append([
            case.label(), fmt_mib(case.logits_bytes), *(fmt_mib(m[k]) for k in harness.METHODS),
            *("—" if m[k] is None else f"{m[k] / case.logits_bytes:.1%}" for k in ("eager", "compiled")),
        ])
    return markdown_table(header, rows)


def targets(results, memory, sections) -> str:
    """Each target of issue 4 as measured: worst case over the measured cases (a target
    none of whose cases was measured is listed as not measured)."""
    fwd = [c for c in results if not c.backward]
    bwd = [c for c in results if c.backward]

    def worst(cases, num, den, fn):
        pairs = [(results[c][num] / results[c][den], c) for c in cases]
        return fn(pairs, key=lambda p: p[0]) if pairs else None

    lines = []

    def check(name, value_case, limit, at_least, unit="×"):
        sign = "≥" if at_least else "≤"
        if value_case is None:
            lines.append([name, f"{sign} {limit}{unit}", "—", "—", "not measured"])
            return
        value, case = value_case
        ok = value >= limit if at_least else value <= limit
        lines.append([name, f"{sign} {limit}{unit}", f"{value:.2f}{unit}", case.label(), "met" if ok else "**missed**"])

    check("compiled fwd vs seed", worst(fwd, "seed", "compiled", min), 15, True)
    check("compiled fwd vs floor", worst(fwd, "compiled", "floor", max), 1.3, False)
    check("compiled fwd+bwd vs seed", worst(bwd, "seed", "compiled", min), 8, True)
    check("compiled fwd+bwd vs floor", worst(bwd, "compiled", "floor", max), 1.5, False)
    check("eager fwd vs seed", worst(fwd, "seed", "eager", min), 5, True)
    check("eager fwd+bwd vs seed", worst(bwd, "seed", "eager", min), 5, True)
    if memory:
        measured = [c for name in MEASURED for c in sections[name]]
        for method in ("eager", "compiled"):
            fwd_mem = [
                ((memory[(c, method)] - ROW_BYTES * c.batch * c.seq) / c.logits_bytes, c)
                for c in measured if not c.backward and (c, method) in memory
            ]
            check(f"{method} fwd extra memory − {ROW_BYTES} B·B·S, / logits",
                  max(fwd_mem, key=lambda p: p[0]) if fwd_mem else None, 0.02, False, "")
            bwd_mem = [
                (memory[(c, method)] / c.logits_bytes, c)
                for c in measured if c.backward and (c, method) in memory
            ]
            check(f"{method} fwd+bwd extra memory / gradient",
                  max(bwd_mem, key=lambda p: p[0]) if bwd_mem else None, 1.1, False)
        # Bounded by the chunk, whatever S is: at most one fp32 chunk of logits, B·chunk·V·4 B.
        chunked = [(memory[(c, "eager")], c) for c in sections["chunk_sweep"] if (c, "eager") in memory]
        if chunked:
            chunk_case = chunked[0][1]
            bound = 4 * chunk_case.batch * chunk_case.chunk * chunk_case.vocab
            lines.append([
                "chunked eager fwd memory",
                f"≤ one fp32 chunk ({fmt_mib(bound)} MiB)",
                ", ".join(f"S={c.seq}: {fmt_mib(m)} MiB" for m, c in chunked),
                f"chunk={chunk_case.chunk}",
                "met" if max(m for m, _ in chunked) <= bound else "**missed**",
            ])
    return markdown_table(["target", "limit", "measured (worst)", "at", "status"], lines)


def plot(results, memory, sections, path: str, device: str) -> bool:
    """The PNG of the fp32 sweep; False (and a note) where it cannot be drawn."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[perf]'): no plot, the tables are written")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [c for c in sections["sweep"] if c.dtype == "float32"]
    if not any(c in results for c in sweep):
        print("no fp32 sweep case was timed: no plot")
        return False
    seqs = sorted({c.seq for c in sweep})
    nan = float("nan")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for col, backward in enumerate((False, True)):
        cases = {c.seq: c for c in sweep if c.backward == backward}
        mode = "forward+backward" if backward else "forward"
        for method in harness.METHODS:
            axes[0, col].plot(seqs, [results.get(cases[s], {}).get(method, nan) * 1e3 for s in seqs],
                              "o-", label=method)
            if memory:
                axes[1, col].plot(seqs, [memory.get((cases[s], method), nan) / 2**20 for s in seqs],
                                  "o-", label=method)
        if memory:
            axes[1, col].plot(seqs, [cases[s].logits_bytes / 2**20 for s in seqs], "k--", label="logits bytes")
        axes[0, col].set_title(f"time, {mode}")
        axes[1, col].set_title(f"peak extra memory, {mode}")
        axes[0, col].set_ylabel("ms per call")
        axes[1, col].set_ylabel("MiB")
        axes[1, col].set_xlabel(f"sequence length S  (B={BATCH}, V={VOCAB}, fp32, TP=1)")
        for row in range(2):
            axes[row, col].set_yscale("log")
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].grid(True, which="both", alpha=0.3)
            axes[row, col].legend(fontsize=8)
    fig.suptitle(f"compiled_logprob token_logprobs vs the seed algorithm ({device}, torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(sections, run: Run, args, repeats: int, *, status: str, png: str | None) -> str:
    cuda = args.device.startswith("cuda")
    timed = [c for name in TIMED for c in sections.get(name, [])]
    text = (
        f"# TP benchmark ({'quick' if args.quick else 'full'})\n\n{harness.machine_header(args.device)}"
        f"- status: {status}\n"
        f"- median of {repeats} calls after one warm-up, methods interleaved; threads: "
        f"{args.threads} (TP=2: 2 gloo processes × 1 thread); times in ms"
        + ("; torch.cuda.synchronize() before and after each timed call (wall time, host launch "
           "overhead included)" if cuda else "")
        + "\n- memory: peak extra over the warmed-up baseline, "
        + ("in process, torch.cuda.reset_peak_memory_stats() then max_memory_allocated − "
           "memory_allocated around one call" if cuda else "one fresh process per method (VmHWM − VmRSS)")
        + "\n"
    )
    if cuda:
        text += (f"- compiled GB/s: minimum traffic (read the logits; fwd+bwd: read twice, write the "
                 f"gradient) over the compiled time, % of {PEAK_BYTES_PER_S / 1e12:.1f} TB/s\n")
    if run.skipped:
        text += "- skipped (time budget): " + "; ".join(run.skipped) + "\n"
    text += f"\n## Time ({len(run.results)} of {len(timed)} cases)\n\n{time_table(run.results, args.device)}\n"
    if run.memory:
        mem_cases = [c for name in (*MEASURED, "chunk_sweep") for c in sections[name]]
        text += f"## Peak extra memory\n\n{memory_table(run.memory, mem_cases)}\n"
    text += f"## Targets\n\n{targets(run.results, run.memory, sections)}\n"
    if png:
        text += f"![time and memory vs S]({png})\n"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer repeats")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per method (median)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (single-process runs)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case starts (the report lists what was skipped)")
    parser.add_argument("--out", default=None, help="output stem (default perf/results/tp_<device>)")
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    repeats = args.repeats or (3 if args.quick else 10 if cuda else 5)
    sections = plan(args.quick, args.device)
    stem = args.out or os.path.join(
        harness.RESULTS_DIR, f"tp_{args.device.split(':')[0]}{'_quick' if args.quick else ''}"
    )
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    run = Run(None if args.time_budget is None else t0 + args.time_budget)

    def save(status="partial: in progress, or interrupted (timed out / failed) here", png=None):
        with open(stem + ".md", "w") as f:
            f.write(report(sections, run, args, repeats, status=status, png=png))

    run.save = save
    save()
    print("timing" + (" and peak memory (in process)" if cuda and not args.no_memory else "") + ":", flush=True)
    run_timings(sections, run, device=args.device, repeats=repeats, memory_in_process=cuda and not args.no_memory)
    if not args.no_memory and not cuda:
        print("peak memory (fresh processes):", flush=True)
        run_memory(sections, run, device=args.device, threads=args.threads)

    png = plot(run.results, run.memory, sections, stem + ".png", args.device)
    status = f"complete ({time.monotonic() - t0:.0f} s)" if not run.skipped else (
        f"finished within the time budget, {len(run.skipped)} step(s) skipped ({time.monotonic() - t0:.0f} s)")
    save(status, os.path.basename(stem) + ".png" if png else None)
    with open(stem + ".md") as f:
        print(f.read())
    print(f"wrote {stem}.md" + (f" and {stem}.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
