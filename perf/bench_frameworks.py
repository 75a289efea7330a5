"""verl's and TRL's own log-prob + entropy calls against their ``compiled_logprob`` drop-ins.

One step is what the framework's actor does per micro-batch: the log-probs of the sampled
tokens and the entropy, from the same ``[B, S, V]`` logits.

* ``verl``: ``logprobs_from_logits`` + ``entropy_from_logits`` as verl runs them without
  flash-attn (``compiled_logprob.testing.frameworks``, restated from verl's source);
* ``trl``: ``selective_log_softmax`` + ``entropy_from_logits`` (TRL's own when TRL is
  installed, else restated from its source);
* ``ours``: ``verl_compat``/``trl_compat`` (the same functions for both), eager;
* ``ours compiled``: the same under ``torch.compile(fullgraph=True)``.

``forward``: under ``torch.no_grad()`` (the old-policy and reference passes); ``training``:
forward and the backward of ``Σ logprobs + Σ entropy``. Time: median of interleaved calls in
one process; peak: the resident memory of one call over that before it, in a fresh process
per (method, dtype, mode). Results: ``perf/results/frameworks_cpu.md``.

    python perf/bench_frameworks.py                         # [2, 1024, 32000], fp32 and bf16
    python perf/bench_frameworks.py --shape 1 1024 152064 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from harness import machine_header, median_interleaved, reset_peak_rss, rss_kib

from compiled_logprob import trl_compat
from compiled_logprob.testing import frameworks

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("verl", "trl", "ours", "ours compiled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _trl_functions():
    try:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    except ImportError:
        return frameworks.trl_selective_log_softmax, frameworks.trl_entropy_from_logits, "restated"
    import trl

    return selective_log_softmax, entropy_from_logits, f"trl {trl.__version__}"


def _both(logprobs_fn, entropy_fn):
    def step(logits, labels):
        return logprobs_fn(logits, labels), entropy_fn(logits)

    return step


def step_functions() -> dict:
    trl_select, trl_entropy, _ = _trl_functions()
    # verl_compat's and trl_compat's pairs are the same calls (verl's inplace_backward is
    # off for the leaf logits measured here): one serves both rows.
    ours = _both(trl_compat.selective_log_softmax, trl_compat.entropy_from_logits)
    return {
        "verl": _both(frameworks.verl_logprobs_from_logits, frameworks.verl_entropy_from_logits),
        "trl": _both(trl_select, trl_entropy),
        "ours": ours,
        "ours compiled": torch.compile(ours, fullgraph=True),
    }


def make_call(method: str, shape: tuple[int, int, int], dtype: str, mode: str, fns: dict):
    gen = torch.Generator().manual_seed(0)
    batch, seq, vocab = shape
    logits = (3 * torch.randn(batch, seq, vocab, generator=gen)).to(DTYPES[dtype])
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    fn = fns[method]
    if mode == "forward":
        def call():
            with torch.no_grad():
                return fn(logits, labels)
        return call
    logits.requires_grad_()

    def call():
        logits.grad = None
        logprobs, entropy = fn(logits, labels)
        (logprobs.float().sum() + entropy.float().sum()).backward()
    return call


def peak_mib(method: str, shape, dtype: str, mode: str) -> float:
    """Runs in a fresh process: the extra resident memory of one call (after a warm-up)."""
    call = make_call(method, shape, dtype, mode, step_functions())
    call()
    reset_peak_rss()
    base = rss_kib("VmRSS")
    call()
    return (rss_kib("VmHWM") - base) / 1024


def _peak_in_fresh_process(method: str, shape, dtype: str, mode: str) -> float:
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); from bench_frameworks import peak_mib; "
        f"print(json.dumps(peak_mib({method!r}, {tuple(shape)!r}, {dtype!r}, {mode!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 1024, 32000], metavar=("B", "S", "V"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = tuple(args.shape)
    fns = step_functions()
    rows = []
    for dtype in DTYPES:
        for mode in ("forward", "training"):
            calls = {m: make_call(m, shape, dtype, mode, fns) for m in METHODS}
            times = median_interleaved(calls, device="cpu", repeats=args.repeats)
            peaks = {m: _peak_in_fresh_process(m, shape, dtype, mode) for m in METHODS}
            for framework in ("verl", "trl"):
                cells = [f"{times[m] * 1e3:.0f} ms / {peaks[m]:.0f} MiB" for m in (framework, "ours", "ours compiled")]
                ratio = times[framework] / times["ours compiled"]
                rows.append(f"| {framework} | {dtype} | {mode} | " + " | ".join(cells) + f" | {ratio:.1f}× |")
                print(rows[-1], flush=True)
    trl_source = _trl_functions()[2]
    report = "\n".join([
        "# verl's and TRL's log-prob + entropy calls vs their drop-ins (CPU)",
        "",
        f"logits {list(shape)}, one step = the sampled tokens' log-probs and the entropy; "
        f"time: median of {args.repeats} interleaved calls; memory: one call's peak resident "
        f"memory over that before it, fresh process each; TRL: {trl_source}; verl: restated "
        "(no flash-attn).",
        "",
        machine_header("cpu"),
        "| framework | dtype | mode | theirs | ours (eager) | ours (compiled) | theirs / ours compiled |",
        "|---|---|---|---:|---:|---:|---:|",
        *rows,
    ]) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "frameworks_cpu.md"), "w") as out:
        out.write(report)
    print(report)


if __name__ == "__main__":
    main()
