"""The single-process paths on a GPU, against the same float64 oracle as the CPU tests.

CI has no GPU: these tests skip there, and ``perf/gpu.sh`` runs this file first on a lent
one (the first GPU run found two faults that no CPU test could see: see README, "On a GPU").
Each case is a CPU test's own kind of case and check (``test_tp_numerics``, ``test_extras``,
``test_filtering``, ``test_lm_head``; they live in ``helpers``) with our call moved to the
device: its inputs go there and its outputs come back through ``Tensor.to``, which autograd
differentiates, so the CPU-side oracle, tolerances and gradient checks are the CPU tests'
own. On CUDA also: no synchronising call (``torch.cuda.set_sync_debug_mode("error")``), a
capture of the eager step in a CUDA graph, and the device-side check of out-of-vocabulary
targets.

``COMPILED_LOGPROB_TEST_DEVICE`` picks the device (default ``cuda``; ``cpu`` dry-runs the
wiring where no GPU is lent).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    LM_HEAD_CASES,
    NUMERICS_APIS,
    NUMERICS_CHUNKABLE,
    ExtrasCase,
    FilterCase,
    LMHeadCase,
    NumericsCase,
    case_id,
    check_extras_case,
    check_filter_case,
    check_lm_head,
    check_numerics_case,
    compiled_per_case,
    extras_ours,
    filter_ours,
    lm_head_oracle,
    numerics_ours,
    run_lm_head,
)
from torch.utils._pytree import tree_map

import compiled_logprob as cl

DEVICE = os.environ.get("COMPILED_LOGPROB_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason="no CUDA device (COMPILED_LOGPROB_TEST_DEVICE=cpu dry-runs these tests)",
)
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="CUDA-only check")


def _to(device: str, tree):
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _on_device(ours, *, compiled: bool = False):
    """A case family's ``ours(case, shard, target, start, group, option)`` run on
    :data:`DEVICE` (compiled with ``fullgraph=True`` when asked), its outputs back on the CPU."""

    run = compiled_per_case(ours) if compiled else ours

    def call(case, shard, target, start, group, option):
        shard, target, option = _to(DEVICE, (shard, target, option))
        return _to("cpu", run(case, shard, target, start, group, option))

    return call


def _check_on_device(check_case, ours, case, *, compiled: bool = False) -> None:
    check_case(case, None, run_ours=_on_device(ours, compiled=compiled))


NUMERICS = [
    *(NumericsCase(api=api) for api in NUMERICS_APIS),
    *(NumericsCase(api=api, dtype="bf16", chunk=6, seed=1) for api in NUMERICS_CHUNKABLE),
    NumericsCase(dtype="fp16", lead=(1,), seed=2),
    NumericsCase(scale=1000.0, ignore=True, seed=3),
    NumericsCase(special="inf_shard", chunk=5, seed=4),
    NumericsCase(special="nan_row", ignore=True, seed=5),
    NumericsCase(lead=(2, 3), seq=1, vocab=7, seed=6),
]
EXTRAS = [
    ExtrasCase(temperature="float", entropy=True, seed=10),
    ExtrasCase(temperature="position", entropy=True, ignore=True, dtype="bf16", seed=11),
    ExtrasCase(k=4, ignore=True, temperature="row", seed=12),
    ExtrasCase(api="vocab_parallel_topk", k=5, temperature="float", seed=13),
    ExtrasCase(api="vocab_parallel_topk", k=3, dtype="bf16", special="inf_shard", seed=14),
    ExtrasCase(api="vocab_parallel_entropy", chunk=4, special="inf_shard", seed=15),
    ExtrasCase(api="vocab_parallel_logsumexp", temperature="position", seed=16),
]
FILTERING = [
    FilterCase(top_k=20, seed=20),
    FilterCase(top_k=None, top_p=0.9, seed=21),
    FilterCase(top_k=10, top_p=0.8, dtype="bf16", temperature="row", seed=22),
    FilterCase(top_k=7, top_p=0.9, special="ties", seed=23),
    FilterCase(top_k=6, top_p=0.9, width=500, special="ties", seed=24),
    FilterCase(top_k=None, top_p=0.9, special="nan_row", chunk=4, seed=25),
    FilterCase(top_k=10, top_p=0.95, ids=3, ignore=True, seed=26),
    FilterCase(top_k=20, top_p=0.8, api="DistributedLogprobWithSampling", chunk=5, seed=27),
]


@pytest.mark.parametrize("case", NUMERICS, ids=case_id)
def test_token_apis(case):
    _check_on_device(check_numerics_case, numerics_ours, case)


@pytest.mark.parametrize("case", EXTRAS, ids=case_id)
def test_extras(case):
    _check_on_device(check_extras_case, extras_ours, case)


@pytest.mark.parametrize("case", FILTERING, ids=case_id)
def test_filtering(case):
    _check_on_device(check_filter_case, filter_ours, case)


NUMERICS_FAMILY = (check_numerics_case, numerics_ours)
EXTRAS_FAMILY = (check_extras_case, extras_ours)
FILTER_FAMILY = (check_filter_case, filter_ours)


@pytest.mark.parametrize(
    ("family", "case"),
    [
        (NUMERICS_FAMILY, NumericsCase(dtype="bf16", special="inf_shard")),
        (EXTRAS_FAMILY, ExtrasCase(temperature="position", entropy=True, ignore=True)),
        (EXTRAS_FAMILY, ExtrasCase(api="vocab_parallel_topk", k=5)),
        (FILTER_FAMILY, FilterCase(top_k=10, top_p=0.8, temperature="row")),
    ],
    ids=["token_logprobs", "entropy", "topk", "filtered"],
)
def test_compiled(family, case):
    """``torch.compile(fullgraph=True)``: Inductor's device code (Triton on CUDA)."""
    _check_on_device(*family, case, compiled=True)


# The last: fp32 logits from bf16 operands, on CUDA one mm with out_dtype.
LM_HEAD_DEVICE_CASES = [LM_HEAD_CASES[0], LM_HEAD_CASES[3], LMHeadCase(dtype="bf16", fp32_logits=True)]


@pytest.mark.parametrize("case", LM_HEAD_DEVICE_CASES, ids=case_id)
def test_lm_head(case):
    def api(hidden, weight, target, **options):
        on_device = _to(DEVICE, (hidden, weight, target))
        return _to("cpu", cl.lm_head_token_logprobs(*on_device, **options))

    check_lm_head(case, run_lm_head(case, 0, 1, None, api=api), lm_head_oracle(case), 0, 1)


def _step_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(2, 37, 1003, generator=gen)).to(torch.bfloat16)
    target = torch.randint(0, 1003, (2, 37), generator=gen)
    upstream = torch.randn(2, 37, generator=gen)
    return _to(DEVICE, (logits, target, upstream))


def _step(logits, target, upstream):
    """Every option at once: temperature per position, entropy, ignore_index, top-k/top-p."""
    positions = target.shape[-1]
    temperature = torch.linspace(0.5, 1.5, positions, device=target.device).expand(target.shape)
    plain, entropy = cl.token_logprobs(
        logits, target, temperature=temperature, return_entropy=True, ignore_index=7
    )
    filtered = cl.token_logprobs(logits, target, top_k=20, top_p=0.9)
    loss = (plain * upstream).sum() + entropy.sum() + torch.nan_to_num(filtered, neginf=0.0).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return plain, entropy, filtered, grad


@pytest.mark.parametrize("dynamic", [False, True])
def test_kernels_compiled_for_other_row_counts_give_the_same_bits(dynamic):
    """Batch invariance with the device's kernels (Triton's on CUDA, whose autotuner may
    pick other block sizes for other row counts): rows scored by the kernels compiled for
    18 rows and for one give the same bits."""
    from test_batch_invariance import check_row_counts

    check_row_counts(dynamic, "bf16", device=DEVICE)


def test_rows_are_the_same_bits_in_any_batch_eager():
    from test_batch_invariance import Case, check_partitions

    for api in ("entropy", "k_ids", "log_softmax", "topk", "filtered"):
        check_partitions(Case(api, "bf16", 3172, 2, 5, 3.0, 5, 0), device=DEVICE)


@cuda_only
def test_no_synchronising_calls():
    """No call waits for the device (``.item()``, a data-dependent shape, a blocking copy):
    CUDA raises on each one in this mode."""
    logits, target, upstream = _step_inputs(0)
    logits.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(logits, target, upstream)
        cl.vocab_parallel_topk(logits, 5)[0].sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda_only
def test_eager_step_captures_in_a_cuda_graph():
    """The eager step (no ``torch.compile``) records in a CUDA graph and its replay on new
    data gives what an eager call gives."""
    static = [x.clone() for x in _step_inputs(0)]
    static[0].requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs require
        _step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _step(*static)
    fresh = _step_inputs(1)
    with torch.no_grad():
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
    graph.replay()
    expected = _step(fresh[0].detach().requires_grad_(), *fresh[1:])
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, equal_nan=True)


@cuda_only
def test_out_of_vocabulary_target_fails_on_the_device():
    """An id outside the vocabulary stops the program with the package's message (CUDA
    reports a failed device-side assert; the process cannot go on, so it runs apart)."""
    program = (
        "import torch, compiled_logprob as cl\n"
        f"logits = torch.randn(2, 5, 7, device={DEVICE!r})\n"
        f"target = torch.full((2, 5), 7, device={DEVICE!r})\n"
        "cl.token_logprobs(logits, target)\n"
        "torch.cuda.synchronize()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode != 0
    assert "not owned by exactly one vocabulary shard" in done.stdout + done.stderr, done.stderr[-2000:]

