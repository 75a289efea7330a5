"""Where the eager path's time goes: ``token_logprobs`` called directly (``eager``) against
NeMo-RL's algorithm (``seed``), per call: the wall time, the kernels it runs and their summed
own time, and its top kernels. On a GPU a wall time far above the kernels' sum means the
host's launches, not the kernels, set the pace.

    python perf/profile_eager.py                  # [2, 2048, 32000] on the CPU
    python perf/profile_eager.py --device cuda    # [2, 8192, 32000]
    python perf/profile_eager.py --quick          # [2, 512, 32000]

Cases: bf16 and fp32, forward and forward+backward, TP = 1; then the eager path's time and
peak memory for each smallest block of its kernels (``_ops.blocks``: many small blocks
launch many small ops, large ones hold a large fp32 workspace). Writes
``perf/results/eager_profile_<device>[_quick].md``, rewritten after every case;
``--time-budget``: no new case starts after that many seconds.
"""

from __future__ import annotations

import argparse
import time

import harness
from harness import Case, markdown_table

from compiled_logprob._ops import blocks

METHODS = ("eager", "seed")
KERNELS_SHOWN = 6
CALLS = 3
BLOCK_ELEMENTS = (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)


def profile_case(case: Case, *, device: str, repeats: int) -> tuple[list[list[str]], list[list[str]]]:
    """The summary rows ``[case, method, wall ms, kernels, kernels' ms, wall / kernels]``
    and the top-kernel rows ``[case, method, kernel, calls, ms, share]`` of one case."""
    inputs = harness.make_inputs(case, 0, device)
    steps = {m: harness.make_step(m, case, inputs, None, {}) for m in METHODS}
    wall = harness.median_interleaved(steps, device=device, repeats=repeats)
    label = f"{case.dtype} {case.mode}"
    summary, top = [], []
    for method, step in steps.items():
        spent = harness.kernel_times(step, device=device, calls=CALLS)
        own = sum(t for t, _, _ in spent) / CALLS / 1e3  # ms per call
        launches = sum(count for _, _, count in spent) / CALLS
        summary.append([
            label, method, f"{wall[method] * 1e3:.2f}", f"{launches:g}", f"{own:.2f}",
            f"{wall[method] * 1e3 / own:.2f}" if own else "—",
        ])
        top += [
            [label, method, f"`{key[:80]}`", f"{count / CALLS:g}", f"{t / CALLS / 1e3:.2f}",
             f"{t / CALLS / 1e3 / own:.0%}"]
            for t, key, count in spent[:KERNELS_SHOWN]
        ]
    return summary, top


def block_rows(case: Case, *, device: str, repeats: int) -> list[list[str]]:
    """``[case, smallest block, ms, peak extra MiB]`` of the eager path for each of
    :data:`BLOCK_ELEMENTS` (the device's minimum block, patched), timed interleaved."""
    name = "MIN_BLOCK_ELEMENTS" if device == "cpu" else "MIN_BLOCK_ELEMENTS_GPU"
    default = getattr(blocks, name)
    inputs = harness.make_inputs(case, 0, device)
    step = harness.make_step("eager", case, inputs, None, {})

    def with_block(elements: int):
        def run():
            setattr(blocks, name, elements)
            try:
                return step()
            finally:
                setattr(blocks, name, default)
        return run

    steps = {elements: with_block(elements) for elements in BLOCK_ELEMENTS}
    times = harness.median_interleaved(steps, device=device, repeats=repeats)
    rows = []
    for elements, run in steps.items():
        # The CPU's peak needs a fresh process per row: bench_tp measures it there.
        peak = harness.cuda_peak_bytes(run) if device.startswith("cuda") else None
        rows.append([
            f"{case.dtype} {case.mode}", f"2**{elements.bit_length() - 1}"
            + (" (default)" if elements == default else ""),
            f"{times[elements] * 1e3:.2f}", harness.fmt_mib(peak),
        ])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="[2, 512, 32000]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case starts")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    seq = 512 if args.quick else 8192 if cuda else 2048
    cases = [Case(2, seq, 32000, d, b) for d in ("bfloat16", "float32") for b in (False, True)]
    summary: list[list[str]] = []
    top: list[list[str]] = []
    by_block: list[list[str]] = []
    status = "complete"
    start = time.monotonic()

    def write(status: str, quiet: bool = True) -> None:
        unit = "device" if cuda else "CPU"
        report = (
            f"# Eager path profile{' (quick)' if args.quick else ''}\n\n"
            f"{harness.machine_header(args.device)}- {status}\n"
            f"- logits [2, {seq}, 32000], TP = 1; wall: median of {args.repeats} interleaved "
            f"calls after a warm-up; kernels: own {unit} time over {CALLS} profiled calls "
            "(torch.profiler), per call\n\n"
            + markdown_table(["case", "method", "wall ms", "kernels", "kernels' ms",
                              "wall / kernels"], summary)
            + f"\n## Top {KERNELS_SHOWN} kernels by own {unit} time, per call\n\n"
            + markdown_table(["case", "method", "kernel", "calls", "ms", "share"], top)
            + "\n## The eager path by smallest block (elements)\n\n"
            + markdown_table(["case", "smallest block", "ms", "peak extra MiB"], by_block)
        )
        harness.write_result("eager_profile", args.device, args.quick, report, quiet=quiet)

    # The profiles first, then the block sizes of the bf16 forward and training.
    jobs = [("profile", case) for case in cases] + [("blocks", case) for case in cases if case.dtype == "bfloat16"]
    for done, (job, case) in enumerate(jobs):
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            status = f"cut short by --time-budget {args.time_budget:g} s: not run: " + ", ".join(
                f"{j} {c.label()}" for j, c in jobs[done:])
            break
        if job == "profile":
            rows, kernels = profile_case(case, device=args.device, repeats=args.repeats)
            summary += rows
            top += kernels
        else:
            by_block += block_rows(case, device=args.device, repeats=args.repeats)
        print(f"  {job} {case.label()} done", flush=True)
        write("partial: in progress, or interrupted")
    write(status, quiet=False)


if __name__ == "__main__":
    main()
