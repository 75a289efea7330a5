"""Log-probs under top-k/top-p filtering: the seed algorithm (NeMo-RL's sort-based
``DistributedLogprobWithSampling``, eager) against ours, eager and compiled, and against
our plain (unfiltered) compiled pass; fp32 and bf16, forward and forward+backward, TP = 1.

    python perf/bench_filtering.py            # [2, 1024, 32000]
    python perf/bench_filtering.py --quick    # [2, 256, 32000]

Writes ``perf/results/filtering_<device>[_quick].md``: medians of interleaved calls after
one warm-up each, rewritten after every case (as ``bench_extras``, with its
``--time-budget``).
"""

from __future__ import annotations

import functools

import harness
import torch
from harness import Case, fmt_time, markdown_table

import compiled_logprob as cl
from compiled_logprob.testing.reference import SeedLogprobWithSampling

FILTERS = {"top_k=50": (50, 1.0), "top_p=0.9": (None, 0.9), "top_k=50, top_p=0.9": (50, 0.9)}


def _plain(logits, target):
    return cl.token_logprobs(logits, target)


# One function per filter (each compiles to its own code object, as in bench_extras).
def _top_k(logits, target):
    return cl.token_logprobs(logits, target, top_k=50)


def _top_p(logits, target):
    return cl.token_logprobs(logits, target, top_p=0.9)


def _top_k_top_p(logits, target):
    return cl.token_logprobs(logits, target, top_k=50, top_p=0.9)


OURS = dict(zip(FILTERS, (_top_k, _top_p, _top_k_top_p)))


def _seed(logits, target, *, top_k, top_p):
    return SeedLogprobWithSampling.apply(logits, target, top_k, top_p)


def _finite(fn):
    """The step's output with its -inf log-probs (targets filtered out) at 0, for backward."""
    return lambda logits, target: torch.nan_to_num(fn(logits, target), neginf=0.0)


def _step(fn, case: Case, logits, target, grad_out):
    if case.backward:
        return lambda: torch.autograd.grad(_finite(fn)(logits, target), logits, grad_out)[0]
    return torch.no_grad()(functools.partial(fn, logits, target))


def time_filters(case: Case, *, device: str, repeats: int) -> dict[tuple[str, str], float]:
    logits, target, grad_out, _, _ = harness.make_inputs(case, 0, device)
    target = torch.where(torch.rand(target.shape, device=target.device) < 0.5, logits.argmax(-1), target)
    torch._dynamo.reset()
    steps = {("plain", "compiled"): _step(torch.compile(_plain, fullgraph=True), case, logits, target, grad_out)}
    for name, (top_k, top_p) in FILTERS.items():
        # Positional: Function.apply takes no keyword arguments before torch 2.12.
        seed = functools.partial(_seed, top_k=top_k, top_p=top_p)
        steps[name, "seed"] = _step(seed, case, logits, target, grad_out)
        steps[name, "eager"] = _step(OURS[name], case, logits, target, grad_out)
        compiled = torch.compile(OURS[name], fullgraph=True)
        steps[name, "compiled"] = _step(compiled, case, logits, target, grad_out)
    return harness.median_interleaved(steps, device=device, repeats=repeats)


def table(results) -> str:
    header = ["case", "filter", "seed ms", "eager ms", "compiled ms", "seed / eager",
              "seed / compiled", "compiled / plain compiled"]
    rows = []
    for case, t in results.items():
        for name in FILTERS:
            rows.append([
                case.label(), name, *(fmt_time(t[name, m]) for m in ("seed", "eager", "compiled")),
                f"{t[name, 'seed'] / t[name, 'eager']:.1f}×",
                f"{t[name, 'seed'] / t[name, 'compiled']:.1f}×",
                f"{t[name, 'compiled'] / t['plain', 'compiled']:.2f}×",
            ])
    return markdown_table(header, rows)


def main(argv=None) -> None:
    harness.case_benchmark(
        argv, name="filtering", title="Filtered log-probs benchmark", measure=time_filters,
        table=table, seq=1024, quick_seq=256, repeats=3,
        legend="- half the targets are their row's argmax; seed: `SeedLogprobWithSampling` "
        "(NeMo-RL's sort-based algorithm, eager); eager / compiled: `token_logprobs(..., "
        "top_k=, top_p=)`; plain compiled: `token_logprobs` unfiltered, compiled\n",
    )


if __name__ == "__main__":
    main()
