"""The distillation loss ``vocab_parallel_cross_entropy(student, teacher)`` against the seed
algorithm (NeMo-RL's ``DistributedCrossEntropy``, eager) and the floor, TP = 1.

    python perf/bench_cross_entropy.py            # [2, 2048, 32000] (~5 min on 2 CPU cores)
    python perf/bench_cross_entropy.py --quick    # [2, 512, 32000]
    python perf/bench_cross_entropy.py --device cuda

Methods, each timed call by call in turn (interleaved) after one warm-up call:

* ``seed``: ``SeedDistributedCrossEntropy`` (fp32 copies, the teacher's softmax and the
  student's log-softmax, saved for backward);
* ``eager``, ``compiled``: :func:`compiled_logprob.vocab_parallel_cross_entropy`, eager and
  under ``torch.compile(fullgraph=True)``;
* ``floor``: one compiled pass that reads both logits once and sums both exponentials (forward),
  plus one compiled elementwise pass that writes the student's gradient (backward).

The teacher is detached (a fixed teacher): the backward is the student's gradient. Writes
``perf/results/cross_entropy_<device>[_quick].md``.
"""

from __future__ import annotations

import harness
import torch
from harness import Case, fmt_time, markdown_table

import compiled_logprob as cl
from compiled_logprob._math import kernels
from compiled_logprob.testing.reference import SeedDistributedCrossEntropy

METHODS = ("seed", "eager", "compiled", "floor")


def _ours(logits, target_logits):
    return cl.vocab_parallel_cross_entropy(logits, target_logits)


def _floor_forward(logits, target_logits):
    return kernels.row_sum(logits.float().exp2() + target_logits.float().exp2())


def _floor_backward(logits, target_logits, grad_out):
    exps = logits.float().exp2() - target_logits.float().exp2()
    return (exps * grad_out.unsqueeze(-1)).to(logits.dtype)


def _steps(case: Case, logits, target_logits, grad_out) -> dict:
    def seed(x, y):
        return SeedDistributedCrossEntropy.apply(x, y, None, not case.backward)

    functions = {"seed": seed, "eager": _ours, "compiled": torch.compile(_ours, fullgraph=True)}
    if case.backward:
        steps = {
            name: lambda fn=fn: torch.autograd.grad(fn(logits, target_logits), logits, grad_out)[0]
            for name, fn in functions.items()
        }
        floor_fwd = torch.compile(_floor_forward, fullgraph=True)
        floor_bwd = torch.compile(_floor_backward, fullgraph=True)
        steps["floor"] = lambda: (
            floor_fwd(logits, target_logits), floor_bwd(logits, target_logits, grad_out)
        )
        return steps
    floor = torch.compile(_floor_forward, fullgraph=True)
    steps = {name: torch.no_grad()(lambda fn=fn: fn(logits, target_logits)) for name, fn in functions.items()}
    steps["floor"] = lambda: floor(logits, target_logits)
    return steps


def time_methods(case: Case, *, device: str, repeats: int) -> dict[str, float]:
    logits, _, grad_out, _, _ = harness.make_inputs(case, 0, device)
    # A teacher close to the student, as in distillation.
    noise = torch.randn(logits.shape, generator=torch.Generator(device=device).manual_seed(7), device=device)
    target_logits = (0.5 * logits.detach().float() + 1.5 * noise).to(logits.dtype)
    torch._dynamo.reset()
    return harness.median_interleaved(
        _steps(case, logits, target_logits, grad_out), device=device, repeats=repeats
    )


def table(results: dict[Case, dict[str, float]]) -> str:
    header = ["case", *(f"{m} ms" for m in METHODS), "seed / eager", "seed / compiled", "compiled / floor"]
    rows = []
    for case, t in results.items():
        rows.append([
            case.label(), *(fmt_time(t[m]) for m in METHODS),
            f"{t['seed'] / t['eager']:.1f}×", f"{t['seed'] / t['compiled']:.1f}×",
            f"{t['compiled'] / t['floor']:.2f}×",
        ])
    return markdown_table(header, rows)


def main(argv=None) -> None:
    harness.case_benchmark(
        argv, name="cross_entropy", title="Distillation cross-entropy benchmark",
        measure=time_methods, table=table, seq=2048, quick_seq=512, repeats=5,
        legend="- student logits as in `bench_tp`, teacher `0.5 · student + 1.5 · noise`, "
        "detached; fwd+bwd: the student's gradient\n",
    )


if __name__ == "__main__":
    main()
