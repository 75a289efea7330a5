"""The peers a user would pick instead, side by side: time, peak extra memory and the largest
error against float64, fp32 and bf16, forward (the old-policy and reference passes) and
training (forward + backward).

Methods (``harness``), all on the same ``[B, S, V]`` logits in one process:

* ``floor``: one compiled read of the logits (and one compiled write of the gradient);
* ``torch_compiled``: ``torch.log_softmax(x.float(), -1).gather(...)`` under
  ``torch.compile`` (what a user writes first);
* ``seed``: NeMo-RL's algorithm (``compiled_logprob.testing.reference``), eager;
* ``eager``, ``compiled``: ``token_logprobs``;
* ``compiled_inplace``: ``token_logprobs(inplace_backward=True)`` compiled, training only (the
  logits consumed, as Megatron's cross-entropy consumes them).

TP = 1 here; megatron-core, ``loss_parallel``, cut-cross-entropy and TP = 2 are the next
steps of the peers issue. Results: ``perf/results/peers_cpu.md``.

    python perf/bench_peers.py              # [2, 2048, 32000]
    python perf/bench_peers.py --seq 512    # quicker
"""

from __future__ import annotations

import argparse

import torch
from harness import (
    Case,
    fmt_mib,
    machine_header,
    make_inputs,
    make_step,
    markdown_table,
    median_interleaved,
    memory_in_fresh_process,
    write_result,
)

from compiled_logprob.testing.reference import oracle_logprobs

FORWARD = ("floor", "torch_compiled", "seed", "eager", "compiled")
TRAINING = (*FORWARD, "compiled_inplace")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    rows = []
    for dtype in ("float32", "bfloat16"):
        for backward in (False, True):
            case = Case(args.batch, args.seq, args.vocab, dtype, backward)
            methods = TRAINING if backward else FORWARD
            cache: dict = {}
            inputs = make_inputs(case, 0, "cpu")
            steps = {m: make_step(m, case, inputs, None, cache) for m in methods}
            times = median_interleaved(steps, device="cpu", repeats=args.repeats)
            del steps, inputs
            peaks = {m: memory_in_fresh_process([case], m, "cpu", threads)[0] for m in methods}
            errors = {m: max_error(case, m) for m in methods}
            best_peer = times["torch_compiled"]
            for m in methods:
                error = "—" if errors[m] is None else f"{errors[m]:.1e}"
                rows.append([
                    dtype, case.mode, m, f"{times[m] * 1e3:.0f}", f"{times[m] / times['floor']:.2f}",
                    f"{times[m] / best_peer:.2f}", fmt_mib(peaks[m]), error,
                ])
            print(f"  {case.label()} done", flush=True)
    table = markdown_table(
        ["dtype", "mode", "method", "ms", "× floor", "× torch compiled", "peak extra MiB",
         "max error vs float64"],
        rows,
    )
    report = (
        f"# Peers side by side (CPU, TP = 1)\n\n{machine_header('cpu')}"
        f"- logits [{args.batch}, {args.seq}, {args.vocab}] (N(0, 9)), {threads} threads; time: "
        f"median of {args.repeats} interleaved calls after a warm-up; peak: one call's resident "
        "memory over that before it, fresh process per method; error: the log-probs "
        "(forward) or the logits' gradient (training) against float64\n\n" + table
    )
    write_result("peers", "cpu", False, report)


if __name__ == "__main__":
    main()
