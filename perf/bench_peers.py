"""The peers a user would pick instead, side by side: time, peak extra memory and the largest
error against float64, fp32 and bf16, forward (the old-policy and reference passes) and
training (forward + backward), TP = 1 and 2.

Methods (``harness``; the peers in ``peers``), all on the same ``[B, S, V]`` logits in one
process per rank:

* ``floor``: one compiled read of the logits (and one compiled write of the gradient);
* ``torch_compiled``: ``torch.log_softmax(x.float(), -1).gather(...)`` compiled (TP = 1);
* ``loss_parallel``, ``loss_parallel_compiled``: DTensor ``F.cross_entropy`` under
  ``loss_parallel``, eager and compiled;
* ``megatron``: megatron-core's ``vocab_parallel_cross_entropy`` (when installed: the
  ``peers`` extra), which consumes fp32 logits;
* ``seed``: NeMo-RL's algorithm (``compiled_logprob.testing.reference``), eager;
* ``eager``, ``compiled``: ``token_logprobs``;
* ``compiled_inplace``: ``token_logprobs(inplace_backward=True)`` compiled, training only.

Peak memory and errors are measured at TP = 1 (fresh process per method). The hidden-state
path against cut-cross-entropy is ``bench_lm_head.py --variant cce``. Results:
``perf/results/peers_cpu.md`` and, drawn from that table (matplotlib), ``peers_cpu.png``.

    python perf/bench_peers.py              # [2, 2048, 32000]
    python perf/bench_peers.py --seq 512    # quicker
    python perf/bench_peers.py --plot-only  # redraw the PNG from the table
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch
from harness import (
    RESULTS_DIR,
    Case,
    fmt_mib,
    machine_header,
    make_inputs,
    make_step,
    markdown_table,
    median_interleaved,
    memory_in_fresh_process,
    tp_worker,
    write_result,
)

from compiled_logprob.testing.multiprocess import GlooPool
from compiled_logprob.testing.reference import oracle_logprobs

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
PEERS = ("torch_compiled", "loss_parallel", "loss_parallel_compiled", *(("megatron",) if HAS_MEGATRON else ()))
FORWARD = ("floor", *PEERS, "seed", "eager", "compiled")
TRAINING = (*FORWARD, "compiled_inplace")
# The compiled torch peers that the ratios are to: the best of them.
TORCH_COMPILED = ("torch_compiled", "loss_parallel_compiled")


def max_error(case: Case, method: str) -> float | None:
    """The largest error of ``method``'s log-probs (forward) or logits' gradient (training)
    against float64 on fresh inputs; ``None`` for the floor, which computes neither."""
    if method == "floor":
        return None
    logits, target, grad_out, _, _ = make_inputs(case, 0, "cpu")
    full = logits.detach().double().requires_grad_()
    want = oracle_logprobs(full, target)
    if case.backward:
        (want_grad,) = torch.autograd.grad(want, full, grad_out.double())
    got = make_step(method, case, (logits, target, grad_out, 0, case.vocab), None, {})()
    if not case.backward:
        return (got.double() - want).abs().max().item()
    return (got.double() - want_grad).abs().max().item()


def _rows(case: Case, times: dict, peaks: dict, errors: dict) -> list[list[str]]:
    best = min(times[m] for m in TORCH_COMPILED if m in times)
    rows = []
    for m, t in times.items():
        error = errors.get(m)
        rows.append([
            case.dtype, case.mode, str(case.tp), m, f"{t * 1e3:.0f}", f"{t / times['floor']:.2f}",
            f"{t / best:.2f}", fmt_mib(peaks[m]) if m in peaks else "",
            "—" if error is None else f"{error:.1e}",
        ])
    return rows


def plot(table_path: str, png_path: str) -> bool:
    """Time per method, one panel per (TP, dtype, mode), from the markdown table; False
    (and a note) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[perf]'): no plot, the table is written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels: dict[tuple[str, str, str], list[tuple[str, float]]] = {}
    with open(table_path) as table:
        for line in table:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 9 and cells[0] in ("float32", "bfloat16"):
                dtype, mode, tp, method, ms = cells[:5]
                panels.setdefault((tp, dtype, mode), []).append((method, float(ms)))
    keys = sorted(panels, key=lambda k: (k[0], k[1] != "float32", k[2] != "fwd"))
    columns = 4
    fig, axes = plt.subplots(-(-len(keys) // columns), columns, figsize=(16, 3.6 * -(-len(keys) // columns)), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        methods, times = zip(*panels[key])
        ours = [m in ("eager", "compiled", "compiled_inplace") for m in methods]
        bars = ax.barh(methods, times, color=["tab:blue" if o else "tab:gray" for o in ours])
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(right=max(times) * 3)
        ax.invert_yaxis()
        ax.set_title(f"TP = {key[0]}, {key[1]}, {key[2]}", fontsize=10)
        ax.set_xlabel("ms per call (log)")
        ax.grid(True, axis="x", which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"token log-probs vs the peers (CPU, torch {torch.__version__}): ours in blue")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the table")
    args = parser.parse_args()
    if args.plot_only:
        plot(os.path.join(RESULTS_DIR, "peers_cpu.md"), os.path.join(RESULTS_DIR, "peers_cpu.png"))
        return
    threads = torch.get_num_threads()
    rows = []
    for tp in args.tp:
        for dtype in ("float32", "bfloat16"):
            for backward in (False, True):
                case = Case(args.batch, args.seq, args.vocab, dtype, backward, tp=tp)
                methods = TRAINING if backward else FORWARD
                if tp == 1:
                    inputs = make_inputs(case, 0, "cpu")
                    steps = {m: make_step(m, case, inputs, None, {}) for m in methods}
                    times = median_interleaved(steps, device="cpu", repeats=args.repeats)
                    del steps, inputs
                    peaks = {m: memory_in_fresh_process([case], m, "cpu", threads)[0] for m in methods}
                    errors = {m: max_error(case, m) for m in methods}
                else:
                    methods = tuple(m for m in methods if m != "torch_compiled")
                    with GlooPool(world_size=tp, timeout=1800) as pool:
                        per_rank = pool.run(tp_worker, [case.__dict__], args.repeats, methods)
                    # A step takes as long as its slowest rank.
                    times = {m: max(rank[0][m] for rank in per_rank) for m in methods}
                    peaks, errors = {}, {}
                rows += _rows(case, times, peaks, errors)
                print(f"  {case.label()} done", flush=True)
    table = markdown_table(
        ["dtype", "mode", "TP", "method", "ms", "× floor", "× best torch compiled",
         "peak extra MiB", "max error vs float64"],
        rows,
    )
    report = (
        f"# Peers side by side (CPU)\n\n{machine_header('cpu')}"
        f"- logits [{args.batch}, {args.seq}, {args.vocab}] (N(0, 9)), {threads} threads per "
        f"process, megatron-core {'installed' if HAS_MEGATRON else 'not installed'}; time: median "
        f"of {args.repeats} interleaved calls after a warm-up (TP = 2: the slower rank, one "
        "process per rank); peak (TP = 1): one call's resident memory over that before it, "
        "fresh process per method; error (TP = 1): the log-probs (forward) or the logits' "
        "gradient (training) against float64; best torch compiled: the faster of "
        "`torch_compiled` and `loss_parallel_compiled`\n\n" + table
    )
    table_path = write_result("peers", "cpu", False, report)
    plot(table_path, table_path.removesuffix(".md") + ".png")


if __name__ == "__main__":
    main()
