"""The cost of the cross-rank agreement check (``compiled_logprob.check_ranks``), eager, on
2 CPU gloo ranks: ``token_logprobs`` forward with the check off and on, interleaved, at a
few sizes. Compiled calls skip the check (a graph is traced once per shape), so their cost
is the plain compiled call's.

    python perf/bench_rank_checks.py [--repeats 20]

Writes ``perf/results/rank_checks_cpu.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import time

import torch
import torch.distributed as dist

import compiled_logprob as cl
from compiled_logprob.testing.multiprocess import GlooPool
from compiled_logprob.testing.reference import vocab_bounds

SHAPES = [(1, 16, 1024), (2, 256, 32000), (2, 2048, 32000)]


def _measure(repeats: int) -> list[tuple[tuple[int, int, int], float, float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for batch, seq, vocab in SHAPES:
        start, end = vocab_bounds(vocab, world, rank)
        logits = torch.randn(batch, seq, end - start)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * repeats + 2):
            checked = bool(i % 2)
            cl.check_ranks(checked)
            dist.barrier()
            begin = time.perf_counter()
            cl.token_logprobs(logits, ids, vocab_start=start, group=dist.group.WORLD)
            times[checked].append(time.perf_counter() - begin)
        cl.check_ranks(False)
        off, on = (statistics.median(times[k][1:]) * 1e3 for k in (False, True))
        rows.append(((batch, seq, vocab), off, on))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with GlooPool(2) as pool:
        rows = pool.run(_measure, args.repeats)[0]
    lines = [
        "# Cost of the cross-rank agreement check, eager",
        "",
        f"`token_logprobs` forward, fp32, 2 gloo ranks (TP = 2), median of {args.repeats} "
        f"interleaved calls each; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}.",
        "",
        "| shape | check off (ms) | check on (ms) | added (ms) | ratio |",
        "|---|---|---|---|---|",
    ]
    for shape, off, on in rows:
        lines.append(f"| {list(shape)} | {off:.2f} | {on:.2f} | {on - off:.2f} | {on / off:.2f}× |")
    out = pathlib.Path(__file__).parent / "results" / "rank_checks_cpu.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
