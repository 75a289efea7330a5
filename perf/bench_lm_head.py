"""Peak memory and time of token log-probs from hidden states vs the logits path and the
peers (CPU, or CUDA with ``--device cuda``).

* ``logits``: ``logits = hidden @ weight.T`` then ``compiled_logprob.token_logprobs`` (eager),
  forward and backward — the ``[B, S, V]`` logits and their gradient exist;
* ``lm_head``: ``compiled_logprob.lm_head.lm_head_token_logprobs`` (eager; its ops are opaque
  to the compiler anyway), forward and backward — they do not.

With ``--topk K`` both score the top K instead (``vocab_parallel_topk`` of the logits
against ``lm_head_topk``: a distillation teacher's top-k, with its gradient). ``--variant``
measures the hidden-state path's options against the logits path doing the same:

* ``filtered``: ``top_k=50, top_p=0.9`` (a sampler's filtered distribution);
* ``fp32_logits``: bf16 hidden states and weight, ``logits_dtype=torch.float32`` against
  the logits path on an fp32 LM head's logits (``hidden.float() @ weight.float().T``) and
  against ``lm_head`` in bf16;
* ``cross_entropy``: ``lm_head_cross_entropy`` against ``vocab_parallel_cross_entropy`` of
  both models' logits, a frozen teacher of the same shapes;
* ``cce``: against Apple cut-cross-entropy's ``linear_cross_entropy(impl="torch_compile")``
  (the peer a CPU user would pick; the optional ``peers`` extra), warmed up (compiled) by
  one step first, and the logits path beside it, eager and compiled; on CUDA instead its
  Triton kernel (``impl="cce"``, the base row there) and Liger-Kernel's
  ``liger_fused_linear_cross_entropy`` (both from ``perf/site`` on a GPU machine).

``--forward`` measures the forward alone (no autograd graph: the old-policy and reference
passes).

Both produce the gradients of the hidden states and the weight. Each row's peak resident
memory is that of one step in a fresh subprocess, over the resident memory just before it
(``VmHWM`` reset through ``/proc/self/clear_refs``); on CUDA, the allocator's peak in the
timing process. The step times come from one more subprocess in which the rows take turns
step by step (median of ``--steps``), so that their ratios come from one run; a row whose
warm-up raises is reported as failed. Results go to ``perf/results/lm_head.md`` (``lm_head_topk.md``
with ``--topk``, ``lm_head_{variant}[_forward][_cuda].md`` otherwise).

    python perf/bench_lm_head.py                   # V = 152064, [1, 8192, 256], fp32
    python perf/bench_lm_head.py --hidden 512 --chunks 110 256
    python perf/bench_lm_head.py --topk 32
    python perf/bench_lm_head.py --seq 2048 --variant filtered   # fp32_logits, cross_entropy
    python perf/bench_lm_head.py --device cuda --variant cce --hidden 2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from harness import (
    cuda_peak_bytes,
    machine_header,
    reset_peak_rss,
    rss_kib,
    short_error,
    sync,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


FILTER = {"top_k": 50, "top_p": 0.9}


def _step(
    method: str, hidden, weight, target, chunk: int | None, topk: int, variant: str, forward: bool
) -> None:
    import compiled_logprob as cl

    if forward:
        with torch.no_grad():
            return _step(method, hidden, weight, target, chunk, topk, variant, False)

    if variant == "filtered":
        if method == "logits":
            logprobs = cl.token_logprobs(hidden @ weight.T, target, **FILTER)
        else:
            logprobs = cl.lm_head_token_logprobs(hidden, weight, target, chunk_size=chunk, **FILTER)
        logprobs = torch.where(logprobs.isinf(), 0.0, logprobs)
    elif variant == "fp32_logits":
        if method == "logits":
            logprobs = cl.token_logprobs(hidden.float() @ weight.float().T, target)
        else:
            dtype = torch.float32 if method == "lm_head" else None  # "lm_head bf16"
            logprobs = cl.lm_head_token_logprobs(hidden, weight, target, chunk_size=chunk, logits_dtype=dtype)
    elif method in ("cce", "cce_triton"):
        from cut_cross_entropy import linear_cross_entropy

        impl = "torch_compile" if method == "cce" else "cce"
        logprobs = -linear_cross_entropy(hidden, weight, target, reduction="none", impl=impl)
    elif method == "logits compiled":
        logprobs = _compiled_logits_path()(hidden, weight, target)
    elif method == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        loss = liger_fused_linear_cross_entropy(hidden.flatten(0, 1), weight, target.flatten(), reduction="none")
        logprobs = -loss.view(target.shape)
    elif variant == "cross_entropy":
        teacher_hidden, teacher_weight = hidden.detach() * 0.5, weight.detach().flip(0)
        if method == "logits":
            logprobs = cl.vocab_parallel_cross_entropy(hidden @ weight.T, teacher_hidden @ teacher_weight.T)
        else:
            logprobs = cl.lm_head_cross_entropy(hidden, weight, teacher_hidden, teacher_weight, chunk_size=chunk)
    elif topk:
        if method == "logits":
            logprobs, _ = cl.vocab_parallel_topk(hidden @ weight.T, topk)
        else:
            logprobs, _ = cl.lm_head_topk(hidden, weight, topk, chunk_size=chunk)
    elif method == "logits":
        logprobs = cl.token_logprobs(hidden @ weight.T, target)
    else:
        logprobs = cl.lm_head_token_logprobs(hidden, weight, target, chunk_size=chunk)
    if logprobs.requires_grad:
        logprobs.sum().backward()


_COMPILED: list = []


def _compiled_logits_path():
    """``token_logprobs(hidden @ weight.T, target)`` under ``torch.compile``: the logits path
    as CCE's ``torch_compile`` runs its own (one graph, the logits materialised)."""
    if not _COMPILED:
        import compiled_logprob as cl

        _COMPILED.append(torch.compile(lambda h, w, t: cl.token_logprobs(h @ w.T, t), fullgraph=True))
    return _COMPILED[0]


def _inputs(batch: int, seq: int, hidden_size: int, vocab: int, variant: str, device: str, dtype: str):
    gen = torch.Generator().manual_seed(0)
    kind = torch.bfloat16 if variant == "fp32_logits" else getattr(torch, dtype)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen).to(device, kind).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    weight = weight.to(device, kind).requires_grad_()
    target = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return hidden, weight, target


def measure(
    method: str,
    batch: int,
    seq: int,
    hidden_size: int,
    vocab: int,
    chunk: int | None,
    topk: int,
    variant: str = "plain",
    forward: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Runs in the subprocess: peak resident memory of one step on the CPU (after a warm-up
    step for a compiled peer)."""
    hidden, weight, target = _inputs(batch, seq, hidden_size, vocab, variant, device, dtype)
    args = (method, hidden, weight, target, chunk, topk, variant, forward)
    if method.startswith("cce") or method == "logits compiled":
        _step(*args)
        hidden.grad = weight.grad = None
    reset_peak_rss()
    baseline = rss_kib("VmRSS")
    _step(*args)
    return {"peak_mib": (rss_kib("VmHWM") - baseline) / 1024}


def time_interleaved(
    methods: list, batch: int, seq: int, hidden_size: int, vocab: int, steps: int, topk: int,
    variant: str = "plain", forward: bool = False, device: str = "cpu", dtype: str = "float32",
) -> dict:
    """Runs in one subprocess: the median step time of each ``(method, chunk)``, the methods
    taking turns step by step after a warm-up step each, so that the machine's noise hits
    them alike and their ratios come from one run. On CUDA also each one's peak allocated
    memory over that before its step. A method whose warm-up raises is left out, its error
    returned in ``errors``."""
    hidden, weight, target = _inputs(batch, seq, hidden_size, vocab, variant, device, dtype)

    def run(method, chunk):
        hidden.grad = weight.grad = None
        _step(method, hidden, weight, target, chunk, topk, variant, forward)

    errors: dict[int, str] = {}
    for i, (method, chunk) in enumerate(methods):
        try:
            run(method, chunk)
        except Exception as error:  # noqa: BLE001 - a peer's failure is reported, not fatal
            errors[i] = short_error(error)
    live = [i for i in range(len(methods)) if i not in errors]
    times: dict[int, list[float]] = {i: [] for i in live}
    for _ in range(steps):
        for i in live:
            sync(device)
            start = time.perf_counter()
            run(*methods[i])
            sync(device)
            times[i].append(time.perf_counter() - start)
    peaks: dict[int, float] = {}
    if device.startswith("cuda"):
        for i in live:
            hidden.grad = weight.grad = None  # the step's own gradients count, not the last's
            peaks[i] = cuda_peak_bytes(lambda: run(*methods[i])) / 2**20
    return {
        "times": [statistics.median(times[i]) if i in times else None for i in range(len(methods))],
        "peaks_mib": [peaks.get(i) for i in range(len(methods))],
        "errors": [errors.get(i) for i in range(len(methods))],
    }


def _run_fresh(function: str, **config) -> dict | list:
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); " \
        f"import bench_lm_head; print(json.dumps(bench_lm_head.{function}(**{config!r})))"
    # A fixed mmap threshold returns freed large buffers to the system, so that a warm-up
    # step's pages are not reused unseen by the measured one.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


TITLES = {
    "plain": "",
    "filtered": "Top-k/top-p filtered log-probs (top_k=50, top_p=0.9)",
    "fp32_logits": "Log-probs with fp32 logits from a bf16 LM head",
    "cross_entropy": "Distillation cross-entropy of two models",
    "cce": "Token log-probs against cut-cross-entropy",
}


def _methods(args) -> tuple[str, list[tuple[str, str, int | None]]]:
    """The base row's name and every row: ``(name, method, chunk)``; the base row first."""
    methods = [("logits path", "logits", None)]
    if args.variant == "cce" and args.device.startswith("cuda"):
        # The Triton kernels a GPU user picks; no torch.compile rows, whose cold compiles
        # would take the GPU run's budget.
        methods = [("cut-cross-entropy cce (Triton)", "cce_triton", None),
                   ("Liger fused linear cross-entropy", "liger", None), *methods]
    elif args.variant == "cce":
        methods = [("cut-cross-entropy torch_compile", "cce", None), *methods,
                   ("logits path, compiled", "logits compiled", None)]
    methods += [(f"lm_head chunk={chunk or 'default'}", "lm_head", chunk or None) for chunk in args.chunks]
    if args.variant == "fp32_logits":
        methods.append(("lm_head, bf16 logits", "lm_head bf16", None))
    return methods[0][0], methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--chunks", type=int, nargs="*", default=[0], help="lm_head chunk sizes (0: default)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=0, help="score the top K instead of a target")
    parser.add_argument("--variant", choices=sorted(TITLES), default="plain")
    parser.add_argument("--forward", action="store_true", help="the forward alone, no autograd")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (peaks from the allocator)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="of the hidden states and the weight")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    shape = dict(
        batch=args.batch, seq=args.seq, hidden_size=args.hidden, vocab=args.vocab, topk=args.topk,
        variant=args.variant, forward=args.forward, device=args.device, dtype=args.dtype,
    )
    base_name, methods = _methods(args)
    timed = _run_fresh("time_interleaved", methods=[m[1:] for m in methods], steps=args.steps, **shape)
    rows = []
    for (name, method, chunk), t, peak, error in zip(
        methods, timed["times"], timed["peaks_mib"], timed["errors"], strict=True
    ):
        if error is None and not cuda:
            peak = _run_fresh("measure", method=method, chunk=chunk, **shape)["peak_mib"]
        rows.append((name, {"time_s": t, "peak_mib": peak, "error": error}))
    base = rows[0][1]
    dtype = "bf16" if args.variant == "fp32_logits" or args.dtype == "bfloat16" else "fp32"
    title = TITLES[args.variant] or f"{f'Top-{args.topk}' if args.topk else 'Token'} log-probs"
    peak_how = (
        "allocated memory (torch.cuda.max_memory_allocated) of the step over that before it"
        if cuda else "resident memory of the step over that before it (fresh process per row)"
    )
    lines = [
        f"# {title} from hidden states vs the {base_name} ({'CUDA' if cuda else 'CPU'}, "
        f"{'forward' if args.forward else 'forward + backward'})",
        "",
        f"hidden [{args.batch}, {args.seq}, {args.hidden}], weight [{args.vocab}, {args.hidden}] "
        f"({dtype}), {torch.get_num_threads()} threads, torch {torch.__version__}. Peak: "
        f"{peak_how}; time: median of {args.steps} steps, matmuls included, the rows taking "
        "turns step by step in one process.",
        "",
        machine_header(args.device),
        f"| method | peak MiB | × {base_name} | step s | × {base_name} |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        if r["error"] is not None:
            lines.append(f"| {name} | failed: {r['error'].replace('|', '/')} | | | |")
            continue
        lines.append(
            f"| {name} | {r['peak_mib']:.0f} | {_ratio(r['peak_mib'], base['peak_mib'], 3)} "
            f"| {r['time_s']:.3f} | {_ratio(r['time_s'], base['time_s'], 2)} |"
        )
    report = "\n".join(lines) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    name = f"lm_head_{args.variant}" if args.variant != "plain" else "lm_head_topk" if args.topk else "lm_head"
    name += ("_forward" if args.forward else "") + ("_cuda" if cuda else "") + ".md"
    with open(os.path.join(RESULTS, name), "w") as out:
        out.write(report)
    print(report)


def _ratio(value: float, base: float | None, digits: int) -> str:
    return "—" if not base else f"{value / base:.{digits}f}"


if __name__ == "__main__":
    main()
