"""CUDA-graph capture of a compiled ``token_logprobs`` training step (the no-host-sync claim).

    python perf/cuda_graphs.py [--device cuda] [--quick]

1. ``torch.compile(mode="reduce-overhead")``: Inductor's cudagraph trees record the step's
   forward and backward graphs and replay them. The check counts the graphs recorded in the
   tree and their replays, and fails where nothing was captured, where new data made it
   record again, where a step did not replay, or where a graph was skipped (a host sync or a
   CPU op would skip it).
2. Manual capture with ``torch.cuda.graph``: the compiled step (default mode) is captured in
   a ``torch.cuda.CUDAGraph`` and replayed on new data copied into its static input buffers.

Each replay, on data that neither warm-up nor capture saw, is compared with an eager call of
the same step on that data; the tolerance follows each output's dtype (see
:func:`_tolerance`). A mismatch or a missing capture exits non-zero. Timings are medians
of calls bracketed by ``torch.cuda.synchronize()``; the reduce-overhead step copies its
non-static inputs into the graphs' static buffers on every call, so the manual capture is
timed both with that copy (the same footing) and as a bare replay.

On ``--device cpu`` (a dry run where no GPU is lent) it runs the same compiled steps and the
same comparisons with eager on new data, captures nothing, and says so. Writes
``perf/results/cuda_graphs_<device>[_quick].md``, rewritten after each row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

import harness

from compiled_logprob import token_logprobs

CHECK_SEEDS = (1, 2)  # new data for the checks; seed 0 is warm-up and capture data
TIMED_CALLS = 10


def step(logprobs_fn, logits, target, grad_out):
    """One training step: fp32 log-probs and the logits' gradient. ``logprobs_fn`` is
    ``token_logprobs`` or its compiled version (whose backward AOTAutograd compiles)."""
    logprobs = logprobs_fn(logits, target)
    (grad,) = torch.autograd.grad(logprobs, logits, grad_out)
    return logprobs, grad


def _inputs(shape, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: fast
    logits = (torch.randn(*shape, generator=gen, device=device) * 3).to(torch.bfloat16)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen, device=device)
    grad_out = torch.randn(*shape[:-1], generator=gen, device=device)
    return logits.requires_grad_(), target, grad_out


def _tolerance(want: torch.Tensor) -> torch.Tensor:
    """Allowed ``|got − want|`` per element: two roundings to the output's dtype apart
    (``2·eps(dtype)·|want|``; the gradient is formed in fp32 and rounded once to the logits'
    bf16) plus fp32 reduction-order noise (``64·eps(fp32)·max|want|``: Inductor sums the
    vocabulary in another order than the eager kernels)."""
    magnitude = want.detach().float().abs()
    return 2 * torch.finfo(want.dtype).eps * magnitude + 64 * torch.finfo(torch.float32).eps * magnitude.max()


@torch.no_grad()
def _compare(got, want) -> tuple[float, float]:
    """(max |got − want|, max of |got − want| / tolerance) over the step's outputs; a
    non-finite difference is an infinite error."""
    max_err, worst = 0.0, 0.0
    for g, w in zip(got, want):
        err = (g.detach().float() - w.detach().float()).abs()
        if not torch.isfinite(err).all():
            return float("inf"), float("inf")
        max_err = max(max_err, err.max().item())
        worst = max(worst, (err / _tolerance(w).clamp_min(torch.finfo(torch.float32).tiny)).max().item())
    return max_err, worst


def _median_ms(fn, device: str, calls: int = TIMED_CALLS) -> float:
    times = []
    for _ in range(calls):
        harness.sync(device)
        t0 = time.perf_counter()
        fn()
        harness.sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class _GraphTreeProbe:
    """What Inductor's cudagraph trees did: graphs recorded in the tree of one device
    (``CUDAGraphNode``, one per captured forward or backward), and replays counted by
    wrapping ``CUDAGraphNode.run_graph``. Private torch API: where it is missing, the
    counts are ``None`` and the check relies on the skip counter alone."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.replays: int | None = None
        try:
            from torch._inductor import cudagraph_trees

            self._trees = cudagraph_trees
            node_cls = cudagraph_trees.CUDAGraphNode
            original = node_cls.run_graph
        except (ImportError, AttributeError):
            self._trees = None
            return
        self.replays = 0

        def run_graph(node):
            self.replays += 1
            return original(node)

        self._original, self._node_cls = original, node_cls
        node_cls.run_graph = run_graph

    def close(self) -> None:
        if self.replays is not None:
            self._node_cls.run_graph = self._original

    def recorded(self) -> int | None:
        if self._trees is None:
            return None
        try:
            manager = self._trees.get_manager(self.device_index, create_if_none_exists=False)
            if manager is None:
                return 0
            count, stack = 0, list(manager.get_roots())
            while stack:
                node = stack.pop()
                count += node.graph is not None
                stack.extend(child for children in node.children.values() for child in children)
            return count
        except (AttributeError, TypeError):  # the private API moved
            return None


def _check_rows(name, status, checks, timings, failures) -> list[str]:
    errors = ", ".join(f"{err:.1e} ({worst:.2f})" for err, worst in checks)
    if any(not worst <= 1.0 for _, worst in checks):
        failures.append(f"{name}: replay differs from eager beyond the tolerance: {errors}")
        status = "**MISMATCH** " + status
    return [name, status, errors, *timings]


class Data:
    """Warm-up/capture inputs (seed 0), the check inputs and eager steps on them."""

    def __init__(self, shape, device: str) -> None:
        self.capture = _inputs(shape, device, 0)
        self.checks = [_inputs(shape, device, seed) for seed in CHECK_SEEDS]
        self.expected = [tuple(x.detach() for x in step(token_logprobs, *data)) for data in self.checks]


def no_graph(device: str, data: Data, failures: list) -> list[str]:
    """The compiled step without CUDA graphs: the reference time."""
    torch._dynamo.reset()
    compiled = torch.compile(token_logprobs, fullgraph=True)
    for _ in range(2):
        step(compiled, *data.capture)
    checks = [_compare(step(compiled, *new), want) for new, want in zip(data.checks, data.expected)]
    ms = _median_ms(lambda: step(compiled, *data.capture), device)
    return _check_rows("torch.compile (default mode), no CUDA graph", "ran", checks, [f"{ms:.3f}", "—"], failures)


def reduce_overhead(device: str, data: Data, failures: list) -> list[str]:
    """``mode="reduce-overhead"``: cudagraph trees on CUDA; plain Inductor on CPU."""
    from torch._dynamo.utils import counters

    is_cuda = device.startswith("cuda")
    torch._dynamo.reset()
    counters.clear()
    probe = _GraphTreeProbe(torch.device(device).index or 0) if is_cuda else None
    try:
        compiled = torch.compile(token_logprobs, mode="reduce-overhead", fullgraph=True)

        def ro_step(inputs):
            # A new iteration: the previous step's graph outputs may now be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
            return step(compiled, *inputs)

        for _ in range(4):  # a warm-up run, then recorded, then replayed (twice, to be sure)
            ro_step(data.capture)
        recorded_before = probe.recorded() if probe else None
        replays_before = probe.replays if probe else None
        # Clone before the next step overwrites the graphs' outputs.
        checks = [_compare([x.detach().clone() for x in ro_step(new)], want)
                  for new, want in zip(data.checks, data.expected)]
        ms = _median_ms(lambda: ro_step(data.capture), device, TIMED_CALLS)
        skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skips" in k and v}
        copied = counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0)
        if not is_cuda:
            status = "n/a on CPU (no capture; compiled step checked on new data)"
            note = "—"
        else:
            recorded = probe.recorded()
            replays = None if probe.replays is None else probe.replays - replays_before
            problems = []
            if skips:
                problems.append(f"skipped: {skips}")
            if recorded is not None and not recorded:
                problems.append("no graph recorded in the cudagraph tree")
            if recorded is not None and recorded != recorded_before:
                problems.append(f"re-recorded on new data ({recorded_before} → {recorded} graphs)")
            steps = len(data.checks) + TIMED_CALLS
            if replays is not None and replays < steps:
                problems.append(f"only {replays} graph replays in {steps} steps")
            counts = (f"{recorded} graphs recorded, {replays} replays in the {steps} checked and timed steps"
                      if recorded is not None else "graph tree not inspectable (private API moved)")
            status = ("captured: " + counts + ", no skips") if not problems else (
                "**NOT captured**: " + "; ".join(problems) + f" ({counts})")
            if problems:
                failures.append('torch.compile(mode="reduce-overhead"): ' + "; ".join(problems))
            note = (f"includes copying the non-static inputs ({copied} over the recorded graphs) into "
                    "their static buffers, like the manual row's time, and the guards' and autograd's "
                    "host overhead")
    finally:
        if probe:
            probe.close()
    return _check_rows('torch.compile(mode="reduce-overhead")', status, checks, [f"{ms:.3f}", note], failures)


def manual_capture(device: str, data: Data, failures: list) -> list[str]:
    """The compiled step (default mode) captured with ``torch.cuda.graph`` and replayed on
    new data copied into its static inputs."""
    name = "torch.cuda.graph manual capture"
    if not device.startswith("cuda"):
        return [name, "n/a on CPU (needs CUDA; nothing captured)", "—", "—", "—"]
    torch._dynamo.reset()
    compiled = torch.compile(token_logprobs, fullgraph=True)
    static_logits, static_target, static_grad = (x.detach().clone() for x in data.capture)
    static_logits.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(compiled, static_logits, static_target, static_grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(compiled, static_logits, static_target, static_grad)

    def load(inputs):
        logits, target, grad_out = inputs
        with torch.no_grad():
            static_logits.copy_(logits)
        static_target.copy_(target)
        static_grad.copy_(grad_out)

    checks = []
    for new, want in zip(data.checks, data.expected):
        load(new)
        graph.replay()
        torch.cuda.synchronize()
        checks.append(_compare(static_out, want))
    copy_ms = _median_ms(lambda: (load(data.capture), graph.replay()), device)
    replay_ms = _median_ms(graph.replay, device)
    return _check_rows(name, f"captured, replayed on {len(data.checks)} new inputs", checks,
                       [f"{copy_ms:.3f}", f"copy of the 3 inputs + replay; bare replay {replay_ms:.3f} ms"],
                       failures)


PATHS = (
    ("torch.compile (default mode), no CUDA graph", no_graph),
    ('torch.compile(mode="reduce-overhead")', reduce_overhead),
    ("torch.cuda.graph manual capture", manual_capture),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    shape = (2, 128, 32000) if args.quick else (2, 4096, 32000)
    rows: list[list[str]] = []
    failures: list[str] = []

    def text(status: str) -> str:
        return (
            f"# CUDA-graph capture of a compiled step\n\n{harness.machine_header(args.device)}"
            f"- status: {status}\n"
            f"- step: token_logprobs + autograd.grad, bf16 logits {list(shape)}, TP=1\n"
            f"- each path is checked on {len(CHECK_SEEDS)} inputs it was not warmed up or captured on, "
            "against an eager step on the same data; error: max |diff| (max |diff| / tolerance, "
            "≤ 1 passes; tolerance 2·eps(output dtype)·|eager| + 64·eps(fp32)·max|eager|)\n"
            f"- ms per step: median of {TIMED_CALLS} calls, synchronized before and after each\n\n"
            + harness.markdown_table(
                ["path", "status", "error per new input", "ms per step", "timing note"], rows)
        )

    def save() -> None:
        harness.write_result("cuda_graphs", args.device, args.quick,
                             text("partial: in progress, or interrupted here"), quiet=True)

    save()
    data = Data(shape, args.device)
    for name, path in PATHS:
        # One path failing (an error in a capture, say) still lets the others run.
        try:
            rows.append(path(args.device, data, failures))
        except Exception as error:  # noqa: BLE001 - reported in the table and the exit status
            traceback.print_exc()
            message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
            failures.append(f"{name}: {message}")
            rows.append([name, f"**FAILED**: {message}", "—", "—", "—"])
        save()
    status = "all checks passed" if not failures else "**FAILED**: " + "; ".join(failures)
    harness.write_result("cuda_graphs", args.device, args.quick, text(status))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
