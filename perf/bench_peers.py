"""The peers a user would pick instead, side by side: time, peak extra memory and the largest
error against float64, fp32 and bf16, forward (the old-policy and reference passes) and
training (forward + backward), TP = 1 and 2 on the CPU, TP = 1 on CUDA.

Methods (``harness``; the peers in ``peers``), all on the same ``[B, S, V]`` logits in one
process per rank:

* ``floor``: one compiled read of the logits (and one compiled write of the gradient);
* ``torch_compiled``: ``torch.log_softmax(x.float(), -1).gather(...)`` compiled (TP = 1);
* ``loss_parallel``, ``loss_parallel_compiled``: DTensor ``F.cross_entropy`` under
  ``loss_parallel``, eager and compiled;
* ``megatron``: megatron-core's ``vocab_parallel_cross_entropy`` (when installed: the
  ``peers`` extra), which consumes fp32 logits;
* ``liger``: Liger-Kernel's ``liger_cross_entropy`` (CUDA; ``perf/site`` on a GPU machine);
* ``seed``: NeMo-RL's algorithm (``compiled_logprob.testing.reference``), eager;
* ``eager``, ``compiled``: ``token_logprobs``;
* ``compiled_inplace``: ``token_logprobs(inplace_backward=True)`` compiled, training only.

Peak memory and errors are measured at TP = 1 (CPU: fresh process per method; CUDA: the
allocator's peak). A peer that is not installed, or raises, is listed under the table
with its reason instead of ending the run. The hidden-state path against cut-cross-entropy
and Liger is ``bench_lm_head.py --variant cce``. Results: ``perf/results/peers_<device>.md``,
rewritten after every configuration, and, drawn from that table (matplotlib), its PNG.

    python perf/bench_peers.py                      # [2, 2048, 32000]
    python perf/bench_peers.py --seq 512            # quicker
    python perf/bench_peers.py --device cuda        # [2, 8192, 32000], TP = 1
    python perf/bench_peers.py --plot-only          # redraw the PNG from the table
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import peers
import torch
from harness import (
    RESULTS_DIR,
    Case,
    cuda_peak_bytes,
    fmt_mib,
    machine_header,
    make_inputs,
    make_step,
    markdown_table,
    median_interleaved,
    memory_in_fresh_process,
    short_error,
    tp_worker,
    write_result,
)

from compiled_logprob.testing.multiprocess import GlooPool
from compiled_logprob.testing.reference import oracle_logprobs

PEERS = ("torch_compiled", "loss_parallel", "loss_parallel_compiled", "megatron", "liger")
FORWARD = ("floor", *PEERS, "seed", "eager", "compiled")
TRAINING = (*FORWARD, "compiled_inplace")
# The compiled torch peers that the ratios are to: the best of them.
TORCH_COMPILED = ("torch_compiled", "loss_parallel_compiled")


def max_error(case: Case, method: str, device: str, compiled_cache: dict) -> float | None:
    """The largest error of ``method``'s log-probs (forward) or logits' gradient (training)
    against float64 on fresh inputs (a consuming method has overwritten its own), with the
    compiled functions of ``compiled_cache``; ``None`` for the floor, which computes
    neither."""
    if method == "floor":
        return None
    logits, target, grad_out, _, _ = make_inputs(case, 0, device)
    full = logits.detach().double().requires_grad_()
    want = oracle_logprobs(full, target)
    if case.backward:
        (want_grad,) = torch.autograd.grad(want, full, grad_out.double())
    got = make_step(method, case, (logits, target, grad_out, 0, case.vocab), None, compiled_cache)()
    if not case.backward:
        return (got.double() - want).abs().max().item()
    return (got.double() - want_grad).abs().max().item()


def _warmed_steps(case: Case, device: str, methods, failures: dict, compiled_cache: dict) -> dict:
    """One step per method that runs here, warmed up once; a method that raises is left out
    and its error kept in ``failures`` (a peer's failure is a result, not the run's end)."""
    inputs = make_inputs(case, 0, device)
    steps = {}
    for m in methods:
        try:
            step = make_step(m, case, inputs, None, compiled_cache)
            step()
        except Exception as error:  # noqa: BLE001 - reported in the table
            failures[m] = short_error(error)
            continue
        steps[m] = step
    return steps


def measure_tp1(case: Case, device: str, repeats: int, threads: int):
    """Times (interleaved), peak extra memory and errors of every method at TP = 1; on the
    CPU each method's peak comes from a fresh process, on CUDA from the allocator's peak."""
    failures: dict = {}
    methods = list(TRAINING if case.backward else FORWARD)
    for m in methods:
        reason = peers.unavailable(m, case.tp, device)
        if reason is not None:
            failures[m] = f"not run: {reason}"
    methods = [m for m in methods if m not in failures]
    # One compile per method, shared by its timed step, its error and (CUDA) its peak.
    compiled_cache: dict = {}
    steps = _warmed_steps(case, device, methods, failures, compiled_cache)
    times = median_interleaved(steps, device=device, repeats=repeats)
    if device.startswith("cuda"):
        peaks = {m: cuda_peak_bytes(steps[m]) for m in times}
    else:  # max RSS is per process
        peaks = {m: memory_in_fresh_process([case], m, device, threads)[0] for m in times}
    del steps
    gc.collect()
    errors = {m: max_error(case, m, device, compiled_cache) for m in times}
    return times, peaks, errors, failures


def _rows(case: Case, times: dict, peaks: dict, errors: dict) -> list[list[str]]:
    best = min((times[m] for m in TORCH_COMPILED if m in times), default=None)
    floor = times.get("floor")
    rows = []
    for m, t in times.items():
        error = errors.get(m)
        rows.append([
            case.dtype, case.mode, str(case.tp), m, f"{t * 1e3:.1f}" if t < 0.1 else f"{t * 1e3:.0f}",
            f"{t / floor:.2f}" if floor else "—", f"{t / best:.2f}" if best else "—",
            fmt_mib(peaks[m]) if m in peaks else "",
            "—" if error is None else f"{error:.1e}",
        ])
    return rows


def plot(table_path: str, png_path: str, kind: str = "cpu") -> bool:
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
    machine = torch.cuda.get_device_name() if kind == "cuda" else "CPU"
    fig.suptitle(f"token log-probs vs the peers ({machine}, torch {torch.__version__}): ours in blue")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (TP = 1 only)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (CPU), 8192 (CUDA)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, nargs="*", default=None, help="default 1 2 (CPU), 1 (CUDA)")
    parser.add_argument("--quick", action="store_true", help="[2, 512, 32000], 3 repeats")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new configuration starts")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the table")
    args = parser.parse_args()
    kind = args.device.split(":")[0]
    name = f"peers_{kind}{'_quick' if args.quick else ''}"
    if args.plot_only:
        plot(os.path.join(RESULTS_DIR, f"{name}.md"), os.path.join(RESULTS_DIR, f"{name}.png"), kind)
        return
    cuda = kind == "cuda"
    seq = 512 if args.quick else args.seq or (8192 if cuda else 2048)
    repeats = 3 if args.quick else args.repeats
    tps = [1] if cuda else args.tp or [1, 2]
    assert not cuda or tps == [1], "TP = 2 runs on gloo CPU ranks only"
    threads = torch.get_num_threads()
    # The inference forward in bf16 first: what a short budget must not cut.
    cases = [
        Case(args.batch, seq, args.vocab, dtype, backward, tp=tp)
        for tp in tps for dtype in ("bfloat16", "float32") for backward in (False, True)
    ]
    rows: list[list[str]] = []
    notes: dict[str, list[str]] = {}  # "`method` why" -> the configurations it applies to
    start = time.monotonic()
    status = "complete"
    for done, case in enumerate(cases):
        if args.time_budget is not None and time.monotonic() - start > args.time_budget:
            status = f"cut short by --time-budget {args.time_budget:g} s: not run: " + ", ".join(
                c.label() for c in cases[done:])
            break
        if case.tp == 1:
            times, peaks, errors, failures = measure_tp1(case, args.device, repeats, threads)
        else:
            methods = [m for m in (TRAINING if case.backward else FORWARD)
                       if peers.unavailable(m, case.tp, "cpu") is None]
            with GlooPool(world_size=case.tp, timeout=1800) as pool:
                per_rank = pool.run(tp_worker, [case.__dict__], repeats, methods)
            # A step takes as long as its slowest rank.
            times = {m: max(rank[0][m] for rank in per_rank) for m in methods}
            peaks, errors, failures = {}, {}, {}
        rows += _rows(case, times, peaks, errors)
        for m, why in failures.items():
            notes.setdefault(f"`{m}` {why}", []).append(f"{case.dtype} {case.mode} TP={case.tp}")
        print(f"  {case.label()} done", flush=True)
        _write(args, seq, repeats, threads, rows, notes, "partial: in progress, or interrupted")
    path = _write(args, seq, repeats, threads, rows, notes, status, quiet=False)
    plot(path, path.removesuffix(".md") + ".png", kind)


def _write(args, seq, repeats, threads, rows, notes, status, quiet=True) -> str:
    cuda = args.device.startswith("cuda")
    table = markdown_table(
        ["dtype", "mode", "TP", "method", "ms", "× floor", "× best torch compiled",
         "peak extra MiB", "max error vs float64"],
        rows,
    )
    where = (
        "peak: torch.cuda.max_memory_allocated of one call over the allocated memory before it"
        if cuda else
        "peak (TP = 1): one call's resident memory over that before it, fresh process per "
        "method"
    )
    report = (
        f"# Peers side by side ({'CUDA' if cuda else 'CPU'})\n\n{machine_header(args.device)}"
        f"- {status}\n"
        f"- logits [{args.batch}, {seq}, {args.vocab}] (N(0, 9)), {threads} threads per process; "
        f"time: median of {repeats} interleaved calls after a warm-up (TP = 2: the slower "
        f"rank, one process per rank); {where}; error (TP = 1): the log-probs (forward) or the "
        "logits' gradient (training) against float64; best torch compiled: the faster of "
        "`torch_compiled` and `loss_parallel_compiled`\n"
        + "".join(f"- {note} ({', '.join(labels)})\n" for note, labels in notes.items())
        + "\n" + table
    )
    return write_result("peers", args.device, args.quick, report, quiet=quiet)


if __name__ == "__main__":
    main()
