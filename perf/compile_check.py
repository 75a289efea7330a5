"""Compile-side numbers of the TP core: collectives per call counted from the compiled
graphs, and cold/warm compile time of one entry point.

    python perf/compile_check.py [--quick]

* Collectives: ``token_logprobs`` is compiled with Inductor on 2 gloo ranks (TP = 2) with a
  post-grad pass that counts the ``_c10d_functional`` collectives (``wait_tensor`` excluded)
  in each graph Inductor lowers: the inference forward, the training forward and the
  backward, unchunked and chunked (compiled, both decompose into the same fused pass).
* Compile time: a fresh process with an empty Inductor cache times the first call (cold);
  a second fresh process on the same cache times it again (warm, cache hit), and so does a
  process with ``TORCHINDUCTOR_VEC_ISA_OK=1``, which skips Inductor's per-process CPU ISA
  probes (a subprocess per candidate ISA that loads a test library, ~1 s on 2 cores).

Writes ``perf/results/compile_<device>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

import harness
from harness import markdown_table

from compiled_logprob import token_logprobs
from compiled_logprob.testing.multiprocess import GlooPool

SHAPE = (2, 256, 32000)


class _CountCollectives(CustomGraphPass):
    """Post-grad pass recording ``(graph kind, collective op names)`` for every graph."""

    def __init__(self) -> None:
        self.graphs: list[tuple[str, list[str]]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
        kind = "backward" if any(p.startswith("tangents") for p in placeholders) else "forward"
        ops = [
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "_c10d_functional"
            and "wait_tensor" not in str(n.target)
        ]
        self.graphs.append((kind, ops))

    def uuid(self) -> None:
        return None  # bypass the FX graph cache: the pass must see every graph


def count_collectives(chunk_size: int | None) -> dict[str, list[str]]:
    """On every rank of a TP = 2 gloo pool: collectives in each compiled graph."""
    rank = dist.get_rank()
    batch, seq, vocab = SHAPE
    start, end = harness.vocab_bounds(vocab, 2, rank)
    logits = torch.randn(batch, seq, end - start, requires_grad=True)
    target = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def fn(z, t):
        return token_logprobs(z, t, vocab_start=start, group=dist.group.WORLD, chunk_size=chunk_size)

    counter = _CountCollectives()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=counter):
        compiled = torch.compile(fn, fullgraph=True)
        with torch.no_grad():
            compiled(logits, target)
        inference = counter.graphs[:]
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        compiled(logits, target).sum().backward()
    training = counter.graphs[len(inference):]
    return {
        "inference forward": [op for _, ops in inference for op in ops],
        "training forward": [op for kind, ops in training if kind == "forward" for op in ops],
        "backward": [op for kind, ops in training if kind == "backward" for op in ops],
    }


def _first_call_seconds(backward: bool, device: str, threads: int) -> float:
    """Seconds of the first compiled call in this process (compile included)."""
    torch.set_num_threads(threads)
    logits = torch.randn(*SHAPE, device=device, requires_grad=backward)
    target = torch.randint(0, SHAPE[-1], SHAPE[:-1], device=device)
    compiled = torch.compile(token_logprobs, fullgraph=True)
    t0 = time.perf_counter()
    if backward:
        compiled(logits, target).sum().backward()
    else:
        with torch.no_grad():
            compiled(logits, target)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def compile_seconds(backward: bool, device: str, threads: int) -> tuple[float, float, float | None]:
    """(cold, warm, warm without CPU ISA probes (CPU only, else None)) first-call seconds,
    each in a fresh process, sharing one new cache."""
    with tempfile.TemporaryDirectory(prefix="compiled_logprob_inductor_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
        code = (
            "import sys, json; sys.path.insert(0, %r); import compile_check; "
            "print(json.dumps(compile_check._first_call_seconds(%r, %r, %d)))"
            % (harness.PERF_DIR, backward, device, threads)
        )
        times = []
        # The skipped probes change the kernels' build key: the first such run rebuilds them.
        no_probes = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
        runs = [{}, {}] + ([no_probes, no_probes] if device == "cpu" else [])
        for extra in runs:
            done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, check=True,
                                  capture_output=True, text=True)
            times.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return times[0], times[1], times[-1] if len(times) > 2 else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="forward+backward compile time only")
    args = parser.parse_args(argv)

    rows = []
    if args.device == "cpu":
        with GlooPool(world_size=2, timeout=900) as pool:
            for chunk in (None, SHAPE[1] // 4):
                counts = pool.run(count_collectives, chunk)[0]
                for graph, ops in counts.items():
                    limit = {"backward": 0}.get(graph, 2)
                    rows.append([f"chunk={chunk}", graph, f"{len(ops)}", ", ".join(ops) or "—",
                                 f"≤ {limit}", "met" if len(ops) <= limit else "**missed**"])
    table = markdown_table(["TP=2 call", "graph", "collectives", "ops", "target", "status"], rows) if rows else ""

    timing_rows = []
    for backward in (True,) if args.quick else (False, True):
        cold, warm, warm_no_probes = compile_seconds(backward, args.device, args.threads)
        entry = "token_logprobs fwd+bwd" if backward else "token_logprobs fwd (no_grad)"
        no_probes = "—" if warm_no_probes is None else f"{warm_no_probes:.1f}"
        timing_rows.append([entry, f"{cold:.1f}", f"{warm:.1f}", no_probes,
                            "met" if cold <= 20 and warm <= 3 else "**missed**"])
    timing = markdown_table(
        ["entry point (first call)", "cold s", "warm s", "warm s, VEC_ISA_OK=1", "target ≤ 20 s / ≤ 3 s"],
        timing_rows,
    )

    report = (
        f"# Compile check\n\n{harness.machine_header(args.device)}- shape {list(SHAPE)} fp32"
        f"{', TP=2 on 2 gloo processes' if rows else ''}; compile times in fresh processes, "
        f"{args.threads} threads\n\n"
        + (f"## Collectives per call (from the compiled graphs)\n\n{table}\n" if rows else "")
        + f"## Compile time\n\n{timing}"
    )
    harness.write_result("compile", args.device, False, report)


if __name__ == "__main__":
    sys.exit(main())
