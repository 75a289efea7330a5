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

import functools

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


def variant_step(fn, case: Case, logits, target, grad_out):
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
        steps[name, "eager"] = variant_step(fn, case, logits, ids, grad_out)
        steps[name, "compiled"] = variant_step(torch.compile(fn, fullgraph=True), case, logits, ids, grad_out)
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


def main(argv=None) -> None:
    harness.case_benchmark(
        argv, name="extras", title="Extras benchmark", measure=time_variants, table=table,
        seq=2048, quick_seq=512, repeats=5,
        legend="- plain: `token_logprobs(logits, target)`; temperature: `temperature=0.7`; "
        "entropy: `return_entropy=True` (log-probs + entropy); k4_ids: `target` `[B, S, 4]`; "
        "topk8: `vocab_parallel_topk(logits, 8)`; ✗: over the 1.10× target\n",
    )


if __name__ == "__main__":
    main()
