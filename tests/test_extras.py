"""Temperature, entropy, ignore_index, K ids per position and the global top-k against the
float64 oracle, forward and backward, on even and uneven vocabulary shards.

Like ``test_tp_numerics``: every rank builds the same full logits from one seed, takes its own
``vocab_bounds`` shard and compares its outputs and its gradient of
``Σ_i sum(output_i · upstream_i)`` with the oracle's (``compiled_logprob.testing.reference``,
which divides by the temperature in float64), sliced at its vocabulary range. TP = 1 runs in
this process with ``group=None``; TP = 2 and 3 on the session's gloo pools.

Tolerances (derived in ``helpers.check_extras_case``): the oracle sees the logits already
rounded to their dtype, so what is left is fp32 math on ``z = logits / temperature`` and the
final rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DTYPES,
    EXTRAS_APIS,
    FP32_EPS,
    IGNORE,
    check_extras_case,
    check_sharded_property,
    rank_and_size,
    run_cases,
)
from helpers import ExtrasCase as Case
from hypothesis import given, settings
from hypothesis import strategies as st

import compiled_logprob as cl
from compiled_logprob._math import kernels, stats, tiles, topk
from compiled_logprob._math.tiles import TILE_WIDTH
from compiled_logprob.testing.reference import oracle_log_softmax, vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

TEMPERATURES = (None, "float", "row", "position")


# ---------------------------------------------------------------------------------------
# Tests

WORLDS = (1, 2, 3)


@pytest.mark.parametrize("world", WORLDS)
def test_temperature(gloo_pool, world):
    """A float, a per-row [B, 1] and a per-position [B, S] temperature, every entry point."""
    cases = [Case(temperature=t, seed=i) for i, t in enumerate(TEMPERATURES[1:])]
    cases += [
        Case(temperature="position", dtype="bf16", seed=3),
        Case(temperature="row", lead=(), seed=4),  # [S, V]: one row
        Case(api="vocab_parallel_logsumexp", temperature="row", seed=5),
        Case(api="vocab_parallel_entropy", temperature="position", dtype="fp16", seed=6),
        Case(api="vocab_parallel_topk", k=5, temperature="position", seed=7),
    ]
    run_cases(gloo_pool, world, check_extras_case, cases)


@pytest.mark.parametrize("world", WORLDS)
def test_entropy(gloo_pool, world):
    """Entropy alone and beside the log-probs: every dtype, x1000 logits, whole -inf shards,
    a NaN logit (its row's entropy is NaN, not 0)."""
    entropy = Case(api="vocab_parallel_entropy")
    cases = [dataclasses.replace(entropy, dtype=d, seed=10) for d in sorted(DTYPES)]
    cases += [
        Case(entropy=True, seed=11),
        # Near-one-hot rows, where lse − Σ_v p_v z_v would cancel catastrophically.
        Case(entropy=True, scale=1000.0, lead=(4,), seed=12),
        Case(entropy=True, scale=1000.0, lead=(4,), dtype="bf16", temperature="row", seed=13),
        Case(entropy=True, special="inf_shard", dtype="bf16", seed=14),
        dataclasses.replace(entropy, special="inf_shard", temperature="position", seed=15),
        dataclasses.replace(entropy, scale=30.0, lead=(1, 2), seed=16),
        dataclasses.replace(entropy, special="nan_row", seed=17),
        Case(entropy=True, special="nan_row", temperature="row", seed=18),
    ]
    run_cases(gloo_pool, world, check_extras_case, cases)


@pytest.mark.parametrize("world", WORLDS)
def test_ignore_index_with_entropy(gloo_pool, world):
    """Ignored positions: log-prob and entropy 0 and no gradient; the rest as without."""
    cases = [
        Case(ignore=True, entropy=True, seed=20),
        Case(ignore=True, entropy=True, chunk=4, temperature="position", dtype="bf16", seed=21),
        Case(ignore=True, entropy=True, k=3, seed=22),
        Case(ignore=True, entropy=True, special="inf_shard", seed=23),
        Case(ignore=True, entropy=True, special="nan_row", seed=24),  # the NaN row ignored
    ]
    run_cases(gloo_pool, world, check_extras_case, cases)


@pytest.mark.parametrize("world", WORLDS)
def test_k_ids(gloo_pool, world):
    """[B, S, K] ids: repeated ids, ids of different shards, ignore_index inside K."""
    cases = [
        Case(k=4, seed=30),
        Case(k=1, seed=31),
        Case(k=4, ignore=True, dtype="bf16", seed=32),
        Case(k=4, entropy=True, temperature="row", chunk=5, seed=33),
        Case(k=2, lead=(), scale=1000.0, seed=34),
    ]
    run_cases(gloo_pool, world, check_extras_case, cases)


@pytest.mark.parametrize("world", WORLDS)
def test_topk(gloo_pool, world):
    """Values and ids equal the oracle's top-k; the log-probs' gradient too."""
    topk = Case(api="vocab_parallel_topk")
    cases = [
        dataclasses.replace(topk, k=1, seed=40),
        dataclasses.replace(topk, k=8, seed=41),
        dataclasses.replace(topk, k=8, dtype="bf16", temperature="row", seed=42),
        dataclasses.replace(topk, k=3, special="inf_shard", chunk=4, seed=43),
        dataclasses.replace(topk, k=8, scale=1000.0, lead=(2, 1), seed=44),
        dataclasses.replace(topk, k=7 // world, vocab=7, seed=45),  # k = the smallest V_local
        # Shards wide enough for the block-maxima selection, with a partial tail block.
        dataclasses.replace(topk, k=2, vocab=3 * 300 + 1, dtype="bf16", seed=46),
        dataclasses.replace(topk, k=8, vocab=4 * 8 * 32 + 17, special="inf_shard", seed=47),
    ]
    run_cases(gloo_pool, world, check_extras_case, cases)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 1500),
    k=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    special=st.sampled_from([None, "ties", "-inf", "nan"]),
    seed=st.integers(0, 2**16),
)
def test_local_topk_selects_the_top_values(vocab, k, dtype, special, seed):
    """The block-maxima top-k returns torch.topk's values, distinct ids holding them and the
    row max."""
    k = min(k, vocab)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, vocab, generator=gen)
    if special == "ties":
        logits = logits.mul(2).round()
    elif special == "-inf":
        logits[0, :, ::2] = float("-inf")
        logits[1, 0] = float("-inf")
    elif special == "nan":
        logits[0, 1, vocab // 2] = float("nan")
    logits = logits.to(dtype)
    values, ids, row_max = topk.local_topk(logits, k)
    expected = logits.topk(k, dim=-1).values
    assert torch.equal(values, expected) or torch.allclose(values, expected, equal_nan=True)
    assert torch.allclose(row_max, logits.amax(-1, keepdim=True), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(logits.gather(-1, ids), values) or special == "nan"
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), "repeated ids"


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 17, 1003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_row_reductions(vocab, dtype):
    """The traced CPU statistics reduce a row over its ``ROW_SLICES`` slices merged
    elementwise, then the entries left over: the max exactly that of one reduction, NaN and
    infinities included, and the sum to fp32 rounding, for rows shorter than the slices,
    divided evenly or not."""
    x = 3 * torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    x[1] = float("-inf")
    x[2, -1] = float("inf")
    x[3, 0] = float("nan")
    x[4, vocab // 2] = float("-inf")
    x[5, -1] = float("nan")
    x = x.to(dtype)
    torch.testing.assert_close(kernels.row_max(x), x.amax(-1, keepdim=True), rtol=0, atol=0, equal_nan=True)
    terms = (x.float() - 2).exp2()
    torch.testing.assert_close(kernels.row_sum(terms), terms.sum(-1, keepdim=True), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_topk_traced(dtype):
    """Compiled, Inductor's own code for the strided block maxima and the candidate gathers
    gives the same values as torch.topk, ids that hold them (ties included) and the row max."""
    gen = torch.Generator().manual_seed(3)
    vocab = 4 * 8 * topk.TOPK_BLOCK + 17  # past the fallback to torch.topk, with a tail
    logits = torch.randn(2, 5, vocab, generator=gen).mul(2).round().to(dtype)
    traced = torch.compile(topk.local_topk, fullgraph=True, dynamic=False)
    values, ids, row_max = traced(logits, 8)
    assert torch.equal(values, logits.topk(8, dim=-1).values)
    assert torch.equal(row_max, logits.amax(-1, keepdim=True))
    assert torch.equal(logits.gather(-1, ids), values)
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), "repeated ids"


@pytest.mark.parametrize("chunk", [1, 4, 13, 20])
def test_chunked(gloo_pool, chunk):
    """Chunks that divide S, do not, equal it and exceed it, on uneven shards (TP = 3)."""
    cases = [
        Case(k=3, entropy=True, ignore=True, temperature="position", chunk=chunk, seed=50),
        Case(api="vocab_parallel_entropy", temperature="row", dtype="bf16", chunk=chunk, seed=51),
        Case(api="vocab_parallel_topk", k=4, temperature="position", chunk=chunk, seed=52),
    ]
    run_cases(gloo_pool, 3, check_extras_case, cases)


def test_tile_statistics_of_empty_and_infinite_rows():
    """A shard's tiles start at its first id, the last one narrower; an all ``-inf`` tile
    (vocabulary padding) sums to 0 with no entropy term and a ``+inf`` max sums to ``inf``,
    traced (base 2) or eager (nats), which agree to fp32 rounding elsewhere."""
    logits = 3 * torch.randn(2, 4, 2 * TILE_WIDTH + 50, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = float("-inf")
    logits[0, 1, 7] = float("inf")
    logits[0, 2, :TILE_WIDTH] = float("-inf")
    temperature = torch.tensor([[0.5, 1.0, 1.5, 2.0], [0.7, 0.9, 1.1, 1.3]])
    traced, eager = (
        stats.local_stats(logits, None, 0, temperature=temperature, with_entropy=True, ops=ops).tiles
        for ops in (kernels.Traced(), kernels.Eager())
    )
    assert traced.shape == (2, 4, 3, 3)
    empty = torch.tensor([float("-inf"), 0.0, 0.0])
    assert torch.equal(traced[0, 0], empty.expand(3, 3))
    assert torch.equal(traced[0, 2, 0], empty)
    assert torch.equal(traced[0, 1, 0, :2], torch.tensor([float("inf"), float("inf")]))
    finite = traced[..., 0].isfinite()
    torch.testing.assert_close(traced[finite], eager[finite])


def test_fixed_point_sums_are_exact_in_any_order():
    terms = TILE_WIDTH * torch.rand(3, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    total = tiles.fixed_point(terms)
    assert torch.equal(total, tiles.fixed_point(terms.flip(-1)))
    assert torch.equal(total, tiles.fixed_point(terms[:, :500]) + tiles.fixed_point(terms[:, 500:]))
    error = (tiles.from_fixed_point(total) - terms.sum(-1)).abs().max().item()
    assert error <= 1000 * 2.0 ** -(tiles.FRACTION_BITS + 1)


@st.composite
def _cases(draw, world: int) -> tuple[Case, int]:
    api = draw(st.sampled_from(EXTRAS_APIS))
    tp = draw(st.integers(1, world))
    seq = draw(st.integers(1, 17))
    vocab = draw(st.integers(world, 80))
    if api == "vocab_parallel_topk":
        k = draw(st.integers(1, min(8, vocab // tp)))
    else:
        k = draw(st.sampled_from([0, 0, 1, 3])) if api == "token_logprobs" else 0
    case = Case(
        api=api,
        lead=draw(st.sampled_from([(), (1,), (3,), (2, 2)])),
        seq=seq,
        vocab=vocab,
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        scale=draw(st.sampled_from([1e-3, 1.0, 30.0, 1000.0])),
        chunk=draw(st.none() | st.integers(1, seq + 2)),
        temperature=draw(st.sampled_from(TEMPERATURES)),
        k=k,
        entropy=api == "token_logprobs" and draw(st.booleans()),
        ignore=api == "token_logprobs" and draw(st.booleans()),
        special=draw(st.sampled_from([None, "inf_shard"])),
        seed=draw(st.integers(0, 2**16)),
    )
    return case, tp


def _check_property(max_examples: int) -> None:
    # A module-level task for the workers (Hypothesis' composite strategies do not pickle).
    check_sharded_property(_cases, check_extras_case, max_examples)


def test_property(gloo_pool):
    """Hypothesis over every option above, B, S, V, TP size (1-3, as subgroups of 3 ranks),
    chunk, dtype and scale, forward and backward, run inside the workers."""
    gloo_pool(3).run(_check_property, 60)


# --- host syncs, bad input ------------------------------------------------------------------


def _host_sync_checks() -> None:
    """Eager forward and backward of every new path under the host-sync dispatch check."""
    group = dist.group.WORLD
    rank, world = rank_and_size(group)
    start, end = vocab_bounds(97, world, rank)
    logits = torch.randn(2, 7, end - start, requires_grad=True)
    ids = torch.randint(0, 97, (2, 7, 3), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = IGNORE
    per_row = torch.tensor([[0.5], [2.0]])
    options = dict(vocab_start=start, group=group, ignore_index=IGNORE, return_entropy=True)
    with no_host_syncs():
        outs = [
            *cl.token_logprobs(logits, ids, temperature=per_row, **options),
            *cl.token_logprobs(logits, ids[..., 0], temperature=0.7, chunk_size=3, **options),
            cl.vocab_parallel_entropy(logits, group=group, chunk_size=4, temperature=per_row),
            cl.vocab_parallel_logsumexp(logits, group=group, temperature=per_row),
            cl.vocab_parallel_topk(logits, 4, vocab_start=start, group=group, chunk_size=3)[0],
            cl.vocab_parallel_topk(logits, 2, vocab_start=start, group=group, temperature=0.5)[0],
        ]
        sum(out.sum() for out in outs).backward()


def test_no_host_syncs(gloo_pool):
    gloo_pool(2).run(_host_sync_checks)


def test_bad_input():
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5, 3))
    bad_temperature = {
        0.0: (ValueError, "temperature must be a finite fp32 number >= 1.18e-38.*got 0.0"),
        -1.0: (ValueError, "temperature must be a finite fp32 number"),
        # Positive, but 0 in fp32 (or 1 / T overflows there).
        1e-50: (ValueError, r"\(1 / temperature must not overflow\), got 1e-50"),
        float("inf"): (ValueError, "got inf"),
        True: (TypeError, "temperature must be a float or a tensor"),
        torch.tensor([[1.0], [0.0]]): (RuntimeError, "finite fp32 number >= 1.18e-38 everywhere"),
        torch.tensor([[1.0], [1e-50]], dtype=torch.float64): (RuntimeError, "everywhere"),
        torch.ones(2, 1, requires_grad=True): (ValueError, r"pass temperature.detach\(\)"),
        torch.ones(2, 6): (ValueError, r"does not broadcast to the positions \(2, 5\)"),
        torch.ones(2, 1, dtype=torch.long): (TypeError, "temperature must be a float tensor"),
    }
    for temperature, (error, message) in bad_temperature.items():
        for call in (
            lambda: cl.token_logprobs(logits, ids, temperature=temperature),
            lambda: cl.vocab_parallel_entropy(logits, temperature=temperature),
            lambda: cl.vocab_parallel_topk(logits, 2, temperature=temperature),
        ):
            with pytest.raises(error, match=message):
                call()
    for k in (0, 12):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, V_local = 11\]"):
            cl.vocab_parallel_topk(logits, k)
    for k in (2.0, True):
        with pytest.raises(TypeError, match="k must be an int"):
            cl.vocab_parallel_topk(logits, k)
    with pytest.raises(ValueError, match="vocab_start must be >= 0, got -5"):
        cl.vocab_parallel_topk(logits, 2, vocab_start=-5)
    for target in (ids[:, :4], ids.unsqueeze(-1), ids[0]):
        with pytest.raises(ValueError, match="or be \\(2, 5\\) \\+ \\(K,\\) for K ids"):
            cl.token_logprobs(logits, target)


def test_no_ids_ignore_nothing():
    """K = 0 ids per position with ``ignore_index``: no position has all its ids ignored, so
    the entropy and its gradient are the full distribution's."""
    logits = torch.randn(2, 5, 11, requires_grad=True)
    no_ids = torch.zeros(2, 5, 0, dtype=torch.long)
    logprobs, entropy = cl.token_logprobs(logits, no_ids, ignore_index=IGNORE, return_entropy=True)
    expected = cl.vocab_parallel_entropy(logits)
    assert logprobs.shape == (2, 5, 0)
    torch.testing.assert_close(entropy, expected, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def _log_softmax_temperature_checks() -> None:
    """This rank's shard of the tempered log-softmax and its gradient against the oracle's,
    for a float and a per-position tensor temperature (V = 37: uneven shards)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rank, world = rank_and_size(group)
    start, end = vocab_bounds(37, world, rank)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, 37, generator=gen, dtype=torch.float64) * 3
    upstream = torch.randn(full.shape, generator=gen, dtype=torch.float64)
    for temperature in (0.7, torch.linspace(0.5, 2.0, 5).expand(2, 5)):
        shard = full[..., start:end].float().requires_grad_()
        out = cl.vocab_parallel_log_softmax(
            shard, group=group, temperature=temperature, dtype=torch.float32
        )
        (grad,) = torch.autograd.grad(out, shard, upstream[..., start:end].float())
        reference = full.clone().requires_grad_()
        ref = oracle_log_softmax(reference, temperature)
        (ref_grad,) = torch.autograd.grad(ref, reference, upstream)
        # A few fp32 ulps of each value, and of the gradient's largest term.
        torch.testing.assert_close(out.double(), ref[..., start:end], rtol=8 * FP32_EPS, atol=8 * FP32_EPS)
        atol = 16 * FP32_EPS * float(upstream.abs().sum(-1).max()) / 0.5
        torch.testing.assert_close(grad.double(), ref_grad[..., start:end], rtol=0, atol=atol)


def test_fp64_temperature_gives_fp32_results():
    """A float64 temperature tensor is used in fp32, as the ops see it: outputs stay fp32."""
    logits = torch.randn(2, 5, 11)
    temperature = torch.full((2, 1), 0.7, dtype=torch.float64)
    assert cl.vocab_parallel_logsumexp(logits, temperature=temperature).dtype == torch.float32
    out = cl.vocab_parallel_log_softmax(logits, temperature=temperature)
    assert out.dtype == torch.float32


def test_log_softmax_temperature(gloo_pool):
    _log_softmax_temperature_checks()
    gloo_pool(2).run(_log_softmax_temperature_checks)
