"""Where the extras' time goes, compiled: the kernels of the plain pass, the entropy and the
top-k (k = 8) by their own time, and the top-k's cost over the plain pass for each block
size of its block maxima (``compiled_logprob._math.topk.TOPK_BLOCK``).

    python perf/profile_extras.py                 # [2, 2048, 32000] fp32
    python perf/profile_extras.py --quick         # [2, 512, 32000]
    python perf/profile_extras.py --device cuda

Writes ``perf/results/extras_profile_<device>[_quick].md``, rewritten after each part. The
kernels come from ``torch.profiler`` over a few calls after a warm-up: self device time of
each kernel on a GPU; on the CPU, self time of each Inductor kernel
(``cpp.enable_kernel_profile``) and ATen call. The block sizes are timed one at a time
(each compiles afresh, the plain pass with it), the plain pass and the top-k interleaved.
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch._inductor.config as inductor_config

import bench_extras
import harness
from harness import Case, markdown_table

from compiled_logprob._math import topk as _math

PROFILED = ("plain", "entropy", "topk8")
BLOCKS = (8, 16, 32, 64)
KERNELS_SHOWN = 8


def kernel_rows(case: Case, name: str, inputs, *, device: str, calls: int) -> list[list[str]]:
    """``[variant, kernel, calls per step, ms per step, share]`` of ``name``'s top kernels, on
    ``inputs`` (:func:`harness.make_inputs`' logits, target and gradient)."""
    logits, target, grad_out = inputs
    fn = torch.compile(bench_extras.VARIANTS[name], fullgraph=True)
    step = bench_extras.variant_step(fn, case, logits, target, grad_out)
    spent = harness.kernel_times(step, device=device, calls=calls)
    total = sum(own for own, _, _ in spent)
    return [
        # Inductor's CPU kernels are named graph_<n>_cpp_fused_..., n counting compiles.
        [
            name, f"`{re.sub(r'^graph_[0-9]+_', '', key)[:90]}`", f"{count / calls:g}",
            f"{own / calls / 1e3:.2f}", f"{own / total:.0%}",
        ]
        for own, key, count in spent[:KERNELS_SHOWN]
    ]


def block_ratio(case: Case, block: int, inputs, *, device: str, repeats: int) -> tuple[float, float]:
    """Median seconds of the plain pass and of the top-k, compiled with ``block``, on
    ``inputs``."""
    default = _math.TOPK_BLOCK
    _math.TOPK_BLOCK = block
    # The block size is read when Inductor decomposes the op, out of sight of Dynamo's guards
    # and the compile caches' keys: each size compiles afresh, with the caches off.
    try:
        with inductor_config.patch(force_disable_caches=True):
            torch._dynamo.reset()
            logits, target, grad_out = inputs
            steps = {
                name: bench_extras.variant_step(
                    torch.compile(bench_extras.VARIANTS[name], fullgraph=True),
                    case, logits, target, grad_out,
                )
                for name in ("plain", "topk8")
            }
            times = harness.median_interleaved(steps, device=device, repeats=repeats)
    finally:
        _math.TOPK_BLOCK = default
    return times["plain"], times["topk8"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="[2, 512, 32000]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    inductor_config.cpp.enable_kernel_profile = True
    seq = 512 if args.quick else 2048
    title = f"# Extras profile{' (quick)' if args.quick else ''}\n\n{harness.machine_header(args.device)}"
    parts = []

    def write(quiet: bool = True) -> None:
        harness.write_result(
            "extras_profile", args.device, args.quick, title + "\n".join(parts), quiet=quiet
        )

    def inputs(case: Case):  # one draw per case, shared by every variant and block size
        return harness.make_inputs(case, 0, args.device)[:3]

    def kernels(case: Case) -> None:
        torch._dynamo.reset()
        drawn = inputs(case)
        rows = [
            row for name in PROFILED
            for row in kernel_rows(case, name, drawn, device=args.device, calls=3)
        ]
        parts.append(
            f"\n## Kernels, compiled, {case.label()}\n\nTop {KERNELS_SHOWN} per variant by own "
            f"{'device' if args.device.startswith('cuda') else 'CPU'} time, over 3 calls after a "
            f"warm-up; ms per call.\n\n"
            + markdown_table(["variant", "kernel", "calls", "ms", "share"], rows)
        )
        write()

    # Forward first, then the block sizes, then forward+backward: a run cut short keeps the
    # first parts (each is written as soon as it is measured).
    forward = Case(2, seq, 32000, "float32", False)
    kernels(forward)
    rows = []
    parts.append("")
    drawn = inputs(forward)
    for block in BLOCKS:
        plain, topk = block_ratio(forward, block, drawn, device=args.device, repeats=args.repeats)
        rows.append([str(block), f"{plain * 1e3:.2f}", f"{topk * 1e3:.2f}", f"{topk / plain:.2f}×"])
        parts[-1] = (
            f"\n## Top-k (k = 8) by block size, compiled, {forward.label()}\n\nMedian of "
            f"{args.repeats} interleaved calls; the default block is {_math.TOPK_BLOCK}.\n\n"
            + markdown_table(["block", "plain ms", "topk8 ms", "topk8 / plain"], rows)
        )
        write()
    kernels(Case(2, seq, 32000, "float32", True))
    write(quiet=False)


if __name__ == "__main__":
    main()
