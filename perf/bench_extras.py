"""Cost of the extras over the plain token log-prob pass: a temperature, the entropy, K = 4
ids per position and the top-k (k = 8), eager and compiled, fp32 and bf16, forward and
forward+backward, TP = 1.

    python perf/bench_extras.py            # [2, 2048, 32000] (~10 min on 2 CPU cores)
    python perf/bench_extras.py --quick    # [2, 512, 32000]
    python perf/bench_extras.py --device cuda

Writes ``perf/results/extras_<device>[_quick].md``. Every variant of one (dtype, mode) is
timed call by call in turn (interleaved, so machine noise hits them alike), after one
warm-up call each; the table gives medians and each variant's ratio to the plain pass of
the same path (eager or compiled). The target is ≤ 1.10× for every extra. The table is
rewritten after every case, so that a run cut short (``--time-budget``: no new case starts
after that many seconds; a timeout) leaves what it measured.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

import harness
from harness import Case, fmt_time, markdown_table

import compiled_logprob as cl

PATHS = ("eager", "compiled")


# One function per variant, so that each compiles to its own code object: closures sharing
# one code object would recompile under a guard on the variant and could hit Dynamo's
# recompile limit. Extras with several outputs are summed so that the backward carries the
# gradient of each; `k4_ids` gets `[B, S, 4]` ids as its target.
def _plain(logits, target):
    return cl.token_logprobs(logits, target)


def _temperature(logits, target):
    return cl.token_logprobs(logits, target, temperature=0.7)


def _entropy(logits, target):
    logprobs, entropy = cl.token_logprobs(logits, target, return_entropy=True)
    return logprobs + entropy


def _k4_ids(logits, ids):
    return cl.token_logprobs(logits, ids).sum(-1)


def _topk8(logits, target):
    return cl.vocab_parallel_topk(logits, 8)[0].sum(-1)


VARIANTS = {
    "plain": _plain, "temperature": _temperature, "entropy": _entropy, "k4_ids": _k4_ids,
    "topk8": _topk8,
}


def _step(fn, case: Case, logits, target, grad_out):
    if case.backward:
        return lambda: torch.autograd.grad(fn(logits, target), logits, grad_out)[0]
    return torch.no_grad()(functools.partial(fn, logits, target))


def time_variants(case: Case, *, device: str, repeats: int) -> dict[tuple[str, str], float]:
    """Median seconds per call of every (variant, path), interleaved repeat by repeat."""
    logits, target, grad_out, _, _ = harness.make_inputs(case, 0, device)
    # Distinct ids spread over the vocabulary, the first one the target.
    ids4 = torch.stack([(target + i * (case.vocab // 4)) % case.vocab for i in range(4)], -1)
    torch._dynamo.reset()  # each case compiles afresh, as a user's first call would
    steps = {}
    for name, fn in VARIANTS.items():
        ids = ids4 if name == "k4_ids" else target
        steps[name, "eager"] = _step(fn, case, logits, ids, grad_out)
        steps[name, "compiled"] = _step(torch.compile(fn, fullgraph=True), case, logits, ids, grad_out)
    return harness.median_interleaved(steps, device=device, repeats=repeats)


def table(results: dict[Case, dict[tuple[str, str], float]]) -> str:
    header = ["case", "variant", "eager ms", "compiled ms", "eager / plain", "compiled / plain"]
    rows = []
    for case, t in results.items():
        for name in VARIANTS:
            ratios = [t[name, path] / t["plain", path] for path in PATHS]
            rows.append([
                case.label(), name, *(fmt_time(t[name, path]) for path in PATHS),
                *(f"{r:.2f}×" + (" ✗" if r > 1.10 else "") for r in ratios),
            ])
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case starts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seq = 512 if args.quick else 2048
    cases = [Case(2, seq, 32000, d, b) for d in ("float32", "bfloat16") for b in (False, True)]

    def report(results, status: str) -> str:
        return (
            f"# Extras benchmark{' (quick)' if args.quick else ''}\n\n"
            + harness.machine_header(args.device)
            + f"- {status}\n"
            f"- median of {args.repeats} calls after one warm-up, all variants interleaved; "
            f"threads: {args.threads}; times in ms; ✗: over the 1.10× target\n"
            "- plain: `token_logprobs(logits, target)`; temperature: `temperature=0.7`; "
            "entropy: `return_entropy=True` (log-probs + entropy); k4_ids: `target` "
            "`[B, S, 4]`; topk8: `vocab_parallel_topk(logits, 8)`\n\n"
            + table(results)
        )

    harness.measure_cases(
        cases, functools.partial(time_variants, device=args.device, repeats=args.repeats), report,
        name="extras", device=args.device, quick=args.quick, time_budget=args.time_budget,
    )

if __name__ == "__main__":
    main()
