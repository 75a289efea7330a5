"""CUDA-graph capture of a compiled ``token_logprobs`` training step (the no-host-sync claim).

    python perf/cuda_graphs.py [--device cuda] [--quick]

1. ``torch.compile(mode="reduce-overhead")``: Inductor's cudagraph trees capture the step;
   the report says whether any graph was skipped (a host sync or a CPU op would skip it).
2. Manual capture with ``torch.cuda.graphs``: the compiled step is captured in a
   ``torch.cuda.CUDAGraph`` and replayed on new data in the static input buffers; the replay
   must equal an eager call.

On ``--device cpu`` (a dry run where no GPU is lent) it runs the same compiled step and the
checks that need no CUDA, and says what it skipped. Writes ``perf/results/cuda_graphs_<device>.md``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import harness

from compiled_logprob import token_logprobs


def step(logprobs_fn, logits, target, grad_out):
    """One training step: fp32 log-probs and the logits' gradient. ``logprobs_fn`` is
    ``token_logprobs`` or its compiled version (whose backward AOTAutograd compiles)."""
    logprobs = logprobs_fn(logits, target)
    (grad,) = torch.autograd.grad(logprobs, logits, grad_out)
    return logprobs, grad


def _inputs(shape, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16).to(device)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(device)
    grad_out = torch.randn(*shape[:-1], generator=gen).to(device)
    return logits.requires_grad_(), target, grad_out


def _max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def run(device: str, shape) -> list[list[str]]:
    rows = []
    logits, target, grad_out = _inputs(shape, device, 0)
    expected = step(token_logprobs, logits, target, grad_out)
    is_cuda = device.startswith("cuda")

    # 1. mode="reduce-overhead" (cudagraph trees on CUDA; plain Inductor on CPU).
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(token_logprobs, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then recorded, then replayed
        got = step(compiled, logits, target, grad_out)
    times = []
    for _ in range(10):
        harness._sync(device)
        t0 = time.perf_counter()
        got = step(compiled, logits, target, grad_out)
        harness._sync(device)
        times.append(time.perf_counter() - t0)
    skips = dict(counters.get("inductor", {}))
    skipped = {k: v for k, v in skips.items() if "cudagraph_skips" in k and v}
    status = "captured" if is_cuda and not skipped else ("skipped: " + str(skipped) if is_cuda else "n/a on CPU")
    rows.append(['torch.compile(mode="reduce-overhead")', status, f"{_max_diff(got, expected):.1e}",
                 f"{sorted(times)[len(times) // 2] * 1e3:.2f}"])

    # 2. Manual capture of the compiled step (default mode) with torch.cuda.graphs.
    torch._dynamo.reset()
    compiled = torch.compile(token_logprobs, fullgraph=True)
    if not is_cuda:
        got = step(compiled, logits, target, grad_out)
        rows.append(["torch.cuda.graphs manual capture", "n/a on CPU (compiled step ran)",
                     f"{_max_diff(got, expected):.1e}", "—"])
        return rows
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(compiled, logits, target, grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(compiled, logits, target, grad_out)
    # New data into the static buffers, replay, compare with eager on the same data.
    new_logits, new_target, new_grad = _inputs(shape, device, 1)
    with torch.no_grad():
        logits.copy_(new_logits)
    target.copy_(new_target)
    grad_out.copy_(new_grad)
    graph.replay()
    torch.cuda.synchronize()
    want = step(token_logprobs, logits, target, grad_out)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rows.append(["torch.cuda.graphs manual capture", "captured, replayed on new data",
                 f"{_max_diff(static_out, want):.1e}", f"{sorted(times)[len(times) // 2] * 1e3:.2f}"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    shape = (2, 128, 32000) if args.quick else (2, 4096, 32000)
    rows = run(args.device, shape)
    report = (
        f"# CUDA-graph capture of a compiled step\n\n{harness.machine_header(args.device)}"
        f"- step: token_logprobs + autograd.grad, bf16 logits {list(shape)}, TP=1\n\n"
        + harness.markdown_table(["capture", "status", "max |diff| vs eager", "ms per step"], rows)
    )
    harness.write_result("cuda_graphs", args.device, args.quick, report)


if __name__ == "__main__":
    sys.exit(main())
