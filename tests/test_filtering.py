"""Log-probs under top-k/top-p filtering against the float64 oracle, forward and backward.

Every rank builds the same full logits from one seed and takes its even vocabulary slice
(filtering needs rank r to hold ``[r · V_local, (r + 1) · V_local)``). The oracle
(``oracle_filtered_log_softmax``) filters in float64; a row whose top-p decision lies within
rounding of the boundary (its margin) may be filtered either way, so such rows are left out
of the comparison (and get no upstream gradient). Half the targets are one of their row's
three most likely ids, so that most are kept.

Tolerances as in ``test_extras``: ``delta``, the fp32 error of a logsumexp-type value of
``z``, for the values; for the gradient ``g · (onehot − p) / T`` with ``p`` over the kept
ids, ``delta · p · |g| / T`` plus the roundings into the gradient's dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import (
    CP_BATCH,
    DTYPES,
    FILTER_MARGIN,
    FP32_EPS,
    IGNORE,
    SamplingParams,
    assert_within,
    check_filter_case,
    check_sharded_property,
    cp_layout,
    rank_and_size,
    ref_shard,
    ref_shard_packed,
    run_cases,
)
from helpers import FilterCase as Case
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard

import compiled_logprob as cl
from compiled_logprob._math import filtering as _math
from compiled_logprob import context_parallel as cp_api
from compiled_logprob.testing.reference import oracle_filtered_log_softmax
from compiled_logprob.testing.sync_check import no_host_syncs

# ---------------------------------------------------------------------------------------
# Tests

FILTERS = [(20, 1.0), (None, 0.9), (50, 0.7), (1, 1.0), (None, 0.2), (5, 0.999)]


@pytest.mark.parametrize("world", (1, 2, 3))
def test_filters(gloo_pool, world):
    """Top-k alone, top-p alone and both; k = 1 (greedy); B·S not divisible by TP (26 rows)."""
    cases = [Case(top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate(FILTERS)]
    run_cases(gloo_pool, world, check_filter_case, cases)


@pytest.mark.parametrize("world", (1, 2, 3))
def test_dtypes_scales_and_edges(gloo_pool, world):
    """bf16/fp16, x1000 logits, ties at the boundaries, whole -inf slices, a NaN row, k > V,
    V >= 64·k (top-k from block maxima)."""
    cases = [
        Case(top_k=10, top_p=0.8, dtype="bf16", seed=10),
        Case(top_k=None, top_p=0.95, dtype="fp16", seed=11),
        Case(top_k=5, top_p=0.5, scale=1000.0, seed=12),
        Case(top_k=7, top_p=0.9, special="ties", seed=13),
        Case(top_k=None, top_p=0.6, special="ties", dtype="bf16", seed=14),
        Case(top_k=30, top_p=0.9, special="inf_shard", seed=15),
        Case(top_k=None, top_p=0.9, special="nan_row", seed=16),
        Case(top_k=100_000, top_p=1.0, seed=17),  # k beyond V filters nothing
        Case(top_k=3, top_p=0.9, lead=(), seq=1, width=7, seed=18),  # [1, V], tiny V
        # V >= 64·k: the block-maxima top-k, ties of the k-th value beyond the k.
        Case(top_k=6, width=500, special="ties", seed=19),
        Case(top_k=6, top_p=0.9, width=500, special="ties", seed=29),
    ]
    run_cases(gloo_pool, world, check_filter_case, cases)


@pytest.mark.parametrize("world", (1, 2, 3))
def test_options(gloo_pool, world):
    """Temperature (float, per row, per position), chunks, K ids, ignore_index, drop-ins."""
    cases = [
        Case(top_k=None, top_p=0.8, temperature="float", seed=20),
        Case(top_k=15, top_p=0.9, temperature="row", seed=21),
        Case(top_k=None, top_p=0.7, temperature="position", dtype="bf16", seed=22),
        Case(top_k=20, top_p=0.9, chunk=4, seed=23),
        Case(top_k=None, top_p=0.9, chunk=20, ignore=True, seed=24),
        Case(top_k=10, top_p=0.95, ids=3, ignore=True, seed=25),
        Case(top_k=20, top_p=0.8, api="DistributedLogprobWithSampling", seed=26),
        Case(top_k=None, top_p=0.8, chunk=5, api="DistributedLogprobWithSampling", seed=27),
        Case(top_k=-1, top_p=0.8, api="DistributedLogprobWithSampling", seed=28),
    ]
    run_cases(gloo_pool, world, check_filter_case, cases)


@settings(max_examples=100, deadline=None)
@given(
    vocab=st.integers(1, 400),
    top_p=st.floats(0.01, 0.99),
    special=st.sampled_from([None, "ties", "-inf", "negative", "signed zeros"]),
    seed=st.integers(0, 2**16),
)
def test_nucleus_threshold_is_the_sorts(vocab, top_p, special, seed):
    """The radix select's threshold equals the one read off the sorted row (mass strictly
    above below ``top_p``), for ties, -inf, negative-only rows and both zeros."""
    x = 3 * torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed))
    if special == "ties":
        x = x.round()
    elif special == "-inf":
        x[:, ::2] = float("-inf")
        x[0, :] = float("-inf")
        x[0, 0] = -2.0
    elif special == "negative":
        x = -x.abs() - 5
    elif special == "signed zeros":
        x = torch.where(x.abs() < 1, 0.0, x) * torch.where(torch.rand(x.shape) < 0.5, -1.0, 1.0)
    ordered = x.double().sort(-1, descending=True).values
    probs = torch.softmax(ordered, -1)
    above = probs.cumsum(-1) - probs
    assume(((above - top_p).abs() > 1e-5).all())  # a rounding's breadth from the boundary
    count = (above < top_p).sum(-1, keepdim=True)
    expected = ordered.gather(-1, count - 1).float()
    assert torch.equal(_math._nucleus_threshold(x, torch.softmax(x, -1), top_p), expected)


@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.8), (7, 0.9), (30, 1.0)])
def test_eager_row_blocks(top_k, top_p):
    """Eager kernels filter a few rows at a time: blocks (the last one short) give each row
    what the whole tensor gives it, bit for bit."""
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(2, 13, 101, generator=generator)
    target = torch.randint(0, 101, (2, 13, 2), generator=generator)
    temperature = 0.5 + torch.rand(2, 13, generator=generator)
    options = {"top_k": top_k or 101, "top_p": top_p}
    whole = _math.filtered_stats(logits, target, temperature, None, None, **options)
    blocks = _math.filtered_stats(
        logits, target, temperature, None, None, rows_per_block=4, **options
    )
    for expected, actual in zip(whole, blocks, strict=True):
        assert torch.equal(actual, expected)


@st.composite
def _cases(draw, world: int) -> tuple[Case, int]:
    tp = draw(st.integers(1, world))
    seq = draw(st.integers(1, 9))
    ids = draw(st.sampled_from([0, 0, 2]))
    case = Case(
        top_k=draw(st.none() | st.integers(1, 40)),
        top_p=draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1])),
        lead=draw(st.sampled_from([(), (1,), (3,), (2, 2)])),
        seq=seq,
        width=draw(st.integers(1, 60)),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        scale=draw(st.sampled_from([1e-3, 1.0, 3.0, 30.0, 1000.0])),
        temperature=draw(st.sampled_from([None, "float", "row", "position"])),
        chunk=draw(st.none() | st.integers(1, seq + 2)),
        ids=ids,
        ignore=draw(st.booleans()),
        special=draw(st.sampled_from([None, "ties", "inf_shard"])),
        seed=draw(st.integers(0, 2**16)),
    )
    return case, tp


def _check_property(max_examples: int) -> None:
    # A module-level task for the workers (Hypothesis' composite strategies do not pickle).
    check_sharded_property(_cases, check_filter_case, max_examples)


def test_property(gloo_pool):
    """Hypothesis over the filters, shapes, TP size (1-3), dtype, scale, temperature, chunk,
    K ids and ignore_index, forward and backward, inside the workers."""
    gloo_pool(3).run(_check_property, 40)


def _host_sync_checks() -> None:
    group = dist.group.WORLD
    rank, world = rank_and_size(group)
    logits = torch.randn(2, 7, 11, requires_grad=True)
    ids = torch.randint(0, 11 * world, (2, 7), generator=torch.Generator().manual_seed(0))
    options = {"vocab_start": rank * 11, "group": group, "ignore_index": IGNORE}
    with no_host_syncs():
        outs = [
            cl.token_logprobs(logits, ids, top_k=5, **options),
            cl.token_logprobs(logits, ids, top_p=0.9, chunk_size=3, temperature=0.7, **options),
            cl.token_logprobs(
                logits, ids, top_k=3, top_p=0.5, temperature=torch.linspace(0.5, 1.5, 2)[:, None],
                **options,
            ),
        ]
        sum(torch.where(out.isfinite(), out, 0.0).sum() for out in outs).backward()


def test_no_host_syncs(gloo_pool):
    gloo_pool(2).run(_host_sync_checks)


# --- under CP: the functional entry points and the drop-ins' sampling_params -----------------


def _check_context_parallel(tp: int, cp: int) -> None:
    """Plain and packed CP rows (and DTensor logits without CP) against the oracle, forward
    and backward, every entry point that takes top_k/top_p or sampling_params."""
    mesh, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    width, seq, top_k, top_p = 23, 13, 8, 0.8
    lo, hi = tp_rank * width, (tp_rank + 1) * width
    padded = -(-seq // (2 * cp)) * 2 * cp
    gen = torch.Generator().manual_seed(7)
    full = 3 * torch.randn(CP_BATCH, padded, tp * width, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, tp * width, (CP_BATCH, seq), generator=gen)
    likely = full[:, : seq - 1].argmax(-1)
    ids[:, 1:] = torch.where(torch.rand(likely.shape, generator=gen) < 0.5, likely, ids[:, 1:])
    upstream = torch.randn(CP_BATCH, seq - 1, generator=gen, dtype=torch.float64)

    leaf = full.clone().requires_grad_()
    log_softmax, margin = oracle_filtered_log_softmax(leaf[:, : seq - 1], top_k, top_p)
    ref = log_softmax.gather(-1, ids[:, 1:, None])[..., 0]
    upstream = torch.where(margin > FILTER_MARGIN, upstream, 0.0).float().double()
    (ref_grad,) = torch.autograd.grad(torch.where(ref.isfinite(), ref, 0.0), leaf, upstream)
    params = SamplingParams(top_k=top_k, top_p=top_p)
    filters = {"top_k": top_k, "top_p": top_p}
    bounds = [(0, padded), (padded, 2 * padded)]

    def packed_layout(x):  # [B, padded, *] -> this rank's [1, 2 · padded / cp, *]
        return ref_shard_packed(x.flatten(0, 1), bounds, cp_rank, cp).unsqueeze(0)

    packed_ids = torch.nn.functional.pad(ids, (0, padded - seq))
    cu = torch.tensor([0, padded, 2 * padded])
    calls = {
        "context_parallel_logprobs": (
            lambda x: cp_api.context_parallel_logprobs(
                x, ids, vocab_start=lo, group=tp_group, cp_group=cp_group, chunk_size=3, **filters
            ),
            ref_shard(full, cp_rank, cp, 1),
            lambda g: ref_shard(g, cp_rank, cp, 1),
        ),
        "from_parallel_logits_to_logprobs": (
            lambda x: cl.from_parallel_logits_to_logprobs(
                x, ids, lo, hi, tp_group, False, cp_group, None, params
            ),
            ref_shard(full, cp_rank, cp, 1),
            lambda g: ref_shard(g, cp_rank, cp, 1),
        ),
        "from_parallel_logits_to_logprobs_packed_sequences": (
            lambda x: cl.from_parallel_logits_to_logprobs_packed_sequences(
                x, packed_ids.flatten()[None], cu, padded, lo, hi, tp_group, cp_group=cp_group,
                sampling_params=params,
            )[:, : seq - 1],
            packed_layout(full),
            packed_layout,
        ),
    }
    if cp == 1:
        calls["get_logprobs_from_vocab_parallel_logits"] = (
            lambda x: cl.get_logprobs_from_vocab_parallel_logits(
                DTensor.from_local(x, mesh, [Replicate(), Shard(2)]), ids, sampling_params=params
            ),
            full,
            lambda g: g,
        )
    for name, (call, logits, layout) in calls.items():
        where = f"{name} tp={tp} cp={cp} rank {dist.get_rank()}"
        shard = logits[..., lo:hi].float().requires_grad_()
        out = call(shard)
        (grad,) = torch.autograd.grad(out, shard, upstream.float())
        settled = (margin > FILTER_MARGIN).expand_as(out)
        assert_within(out[settled], ref[settled], 1e-4 + FP32_EPS * ref[settled].abs(), where)
        # Every CP rank's loss holds every position: a rank's logits get cp times the oracle's.
        expected = cp * layout(ref_grad)[..., lo:hi]
        assert_within(grad, expected, 1e-5 * (1 + expected.abs()), f"{where} gradient")


@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "cp2", "tp2xcp2"])
def test_context_parallel(gloo_pool, tp, cp):
    gloo_pool(tp * cp).run(_check_context_parallel, tp, cp)
