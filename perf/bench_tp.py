"""Vocab-parallel (TP) log-prob benchmark: seed reference vs our eager and compiled paths vs
the floor, forward and forward+backward, fp32 and bf16, TP = 1 and 2, chunked and not.

    python perf/bench_tp.py            # full run (~15 min on 2 CPU cores)
    python perf/bench_tp.py --quick    # small shapes, a few minutes
    python perf/bench_tp.py --device cuda   # what perf/gpu.sh runs on a GPU

Prints the tables and writes ``perf/results/tp_<device>[_quick].md`` and ``.png`` (time and
peak extra memory vs sequence length). Needs matplotlib (``pip install -e '.[perf]'``).
TP = 2 runs on CPU gloo processes only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import harness
from harness import Case, fmt_mib, fmt_time, markdown_table

from compiled_logprob.testing.multiprocess import GlooPool

BATCH, VOCAB, BIG_VOCAB = 2, 32000, 152064
# Allowance for "O(B*S)" in the forward memory target: 16 fp32 values per row.
ROW_BYTES = 64


def plan(quick: bool, device: str) -> dict[str, list[Case]]:
    """The cases of each section. ``sweep`` feeds the plot (TP = 1, sequence lengths)."""
    seqs = [128, 512] if quick else [512, 1024, 2048, 4096]
    long_seq = seqs[-1]
    big_seq = 128 if quick else 1024
    chunk = long_seq // 4
    dtypes = ("float32", "bfloat16")
    modes = (False, True)
    sections = {
        "sweep": [Case(BATCH, s, VOCAB, d, b) for d in dtypes for b in modes for s in seqs],
        "big_vocab": [Case(1, big_seq, BIG_VOCAB, d, b) for d in dtypes for b in modes],
        "chunked": [Case(BATCH, long_seq, VOCAB, "float32", b, chunk=chunk) for b in modes],
        "tp2": [Case(BATCH, long_seq, VOCAB, d, b, tp=2) for d in dtypes for b in modes]
        + [Case(BATCH, long_seq, VOCAB, "float32", True, tp=2, chunk=chunk)],
    }
    if device != "cpu":
        del sections["tp2"]  # gloo TP runs on CPU processes; one GPU here
    return sections


def run_timings(sections, *, device: str, repeats: int) -> dict[Case, dict[str, float]]:
    results: dict[Case, dict[str, float]] = {}
    compiled_cache: dict = {}
    for name, cases in sections.items():
        if name == "tp2":
            continue
        for case in cases:
            results[case] = harness.time_case(
                case, device=device, repeats=repeats, compiled_cache=compiled_cache
            )
            print(f"  {case.label()}: " + ", ".join(f"{m} {fmt_time(t)} ms" for m, t in results[case].items()), flush=True)
    tp_cases = sections.get("tp2", [])
    if tp_cases:
        with GlooPool(world_size=2, timeout=1800) as pool:
            per_rank = pool.run(harness.tp_worker, [c.__dict__ for c in tp_cases], repeats)
        for i, case in enumerate(tp_cases):
            # A TP step is as slow as its slowest rank.
            results[case] = {m: max(rank[i][m] for rank in per_rank) for m in harness.METHODS}
            print(f"  {case.label()}: " + ", ".join(f"{m} {fmt_time(t)} ms" for m, t in results[case].items()), flush=True)
    return results


def run_memory(sections, *, device: str, threads: int) -> dict[tuple[Case, str], int]:
    """Peak extra bytes per (case, method): one fresh process per method and mode."""
    memory: dict[tuple[Case, str], int] = {}
    groups: dict[tuple, list[Case]] = {}
    for case in sections["sweep"] + sections["big_vocab"] + sections["chunked"]:
        groups.setdefault((case.dtype, case.backward, case.chunk), []).append(case)
    chunk_sweep = [Case(BATCH, s, VOCAB, "float32", False, chunk=sections["chunked"][0].chunk)
                   for s in sorted({c.seq for c in sections["sweep"]})]
    groups[("float32", False, "chunk-sweep")] = chunk_sweep
    sections["chunk_sweep"] = chunk_sweep
    for key, cases in groups.items():
        for method in harness.METHODS:
            if key[2] == "chunk-sweep" and method not in ("eager", "seed"):
                continue
            if device == "cpu":  # max RSS is per process
                measured = harness.memory_in_fresh_process(cases, method, device, threads)
            else:  # the CUDA allocator's peak resets exactly, in process
                measured = harness.memory_sweep([c.__dict__ for c in cases], method, device)
            for case, nbytes in zip(cases, measured):
                memory[(case, method)] = nbytes
        print(f"  memory {key}: done", flush=True)
    return memory


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
    """Each target of issue 4 as measured: worst case over the measured cases."""
    fwd = [c for c in results if not c.backward]
    bwd = [c for c in results if c.backward]

    def worst(cases, num, den, fn):
        pairs = [(results[c][num] / results[c][den], c) for c in cases]
        return fn(pairs, key=lambda p: p[0])

    lines = []

    def check(name, value_case, limit, at_least, unit="×"):
        value, case = value_case
        ok = value >= limit if at_least else value <= limit
        sign = "≥" if at_least else "≤"
        lines.append([name, f"{sign} {limit}{unit}", f"{value:.2f}{unit}", case.label(), "met" if ok else "**missed**"])

    check("compiled fwd vs seed", worst(fwd, "seed", "compiled", min), 15, True)
    check("compiled fwd vs floor", worst(fwd, "compiled", "floor", max), 1.3, False)
    check("compiled fwd+bwd vs seed", worst(bwd, "seed", "compiled", min), 8, True)
    check("compiled fwd+bwd vs floor", worst(bwd, "compiled", "floor", max), 1.5, False)
    check("eager fwd vs seed", worst(fwd, "seed", "eager", min), 5, True)
    check("eager fwd+bwd vs seed", worst(bwd, "seed", "eager", min), 5, True)
    if memory:
        for method in ("eager", "compiled"):
            fwd_mem = [
                ((memory[(c, method)] - ROW_BYTES * c.batch * c.seq) / c.logits_bytes, c)
                for c in sections["sweep"] + sections["big_vocab"] + sections["chunked"]
                if not c.backward and (c, method) in memory
            ]
            check(f"{method} fwd extra memory − {ROW_BYTES} B·B·S, / logits", max(fwd_mem, key=lambda p: p[0]), 0.02, False, "")
            bwd_mem = [
                (memory[(c, method)] / c.logits_bytes, c)
                for c in sections["sweep"] + sections["big_vocab"] + sections["chunked"]
                if c.backward and (c, method) in memory
            ]
            check(f"{method} fwd+bwd extra memory / gradient", max(bwd_mem, key=lambda p: p[0]), 1.1, False)
        # Bounded by the chunk, whatever S is: at most one fp32 chunk of logits, B·chunk·V·4 B.
        chunked = [(memory[(c, "eager")], c) for c in sections["chunk_sweep"]]
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


def plot(results, memory, sections, path: str, device: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[perf]'): no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [c for c in sections["sweep"] if c.dtype == "float32"]
    seqs = sorted({c.seq for c in sweep})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for col, backward in enumerate((False, True)):
        cases = {c.seq: c for c in sweep if c.backward == backward}
        mode = "forward+backward" if backward else "forward"
        for method in harness.METHODS:
            axes[0, col].plot(seqs, [results[cases[s]][method] * 1e3 for s in seqs], "o-", label=method)
            if memory:
                axes[1, col].plot(seqs, [memory.get((cases[s], method), float("nan")) / 2**20 for s in seqs],
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer repeats")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per method (median)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (single-process runs)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--out", default=None, help="output stem (default perf/results/tp_<device>)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 5)
    sections = plan(args.quick, args.device)
    print("timing:", flush=True)
    results = run_timings(sections, device=args.device, repeats=repeats)
    memory = {}
    if not args.no_memory:
        print("peak memory (fresh processes):", flush=True)
        memory = run_memory(sections, device=args.device, threads=args.threads)

    stem = args.out or os.path.join(
        harness.RESULTS_DIR, f"tp_{args.device.split(':')[0]}{'_quick' if args.quick else ''}"
    )
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    report = (
        f"# TP benchmark ({'quick' if args.quick else 'full'})\n\n{harness.machine_header(args.device)}"
        f"- median of {repeats} calls after one warm-up, methods interleaved; threads: "
        f"{args.threads} (TP=2: 2 gloo processes × 1 thread); times in ms\n"
        f"- memory: peak extra over the warmed-up baseline, one fresh process per method "
        f"({'VmHWM − VmRSS' if args.device == 'cpu' else 'max_memory_allocated − memory_allocated'})\n\n"
        f"## Time\n\n{time_table(results, args.device)}\n"
    )
    if memory:
        mem_cases = sections["sweep"] + sections["big_vocab"] + sections["chunked"] + sections["chunk_sweep"]
        report += f"## Peak extra memory\n\n{memory_table(memory, mem_cases)}\n"
    report += f"## Targets\n\n{targets(results, memory, sections)}\n"
    report += f"![time and memory vs S]({os.path.basename(stem)}.png)\n"
    with open(stem + ".md", "w") as f:
        f.write(report)
    plot(results, memory, sections, stem + ".png", args.device)
    print(report)
    print(f"wrote {stem}.md and {stem}.png")


if __name__ == "__main__":
    sys.exit(main())
