"""The NeMo-RL drop-ins behave like the eager algorithm they replace (the seed), called the
same way, positional arguments included. Numerics against the float64 oracle are in
``test_tp_numerics``; this file pins the drop-in contract itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import SamplingParams

import compiled_logprob as cl
from compiled_logprob.testing.reference import (
    SeedChunkedDistributedLogprob,
    SeedDistributedLogprob,
    oracle_entropy,
    oracle_logprobs,
    vocab_bounds,
)

VOCAB = 1003


def _compare_with_seed(chunk_size: int | None) -> None:
    """Same positional call on our drop-in and on the seed: same values, same gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = vocab_bounds(VOCAB, world, rank)
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(2, 9, VOCAB, generator=gen)
    target = torch.randint(0, VOCAB, (2, 9), generator=gen)
    upstream = torch.randn(2, 9, generator=gen)
    group = dist.group.WORLD
    if chunk_size is None:
        ours_fn = lambda x: cl.DistributedLogprob.apply(x, target, start, end, group, False)  # noqa: E731
        seed_fn = lambda x: SeedDistributedLogprob.apply(x, target, start, end, group, False)  # noqa: E731
    else:
        ours_fn = lambda x: cl.ChunkedDistributedLogprob.apply(x, target, start, end, chunk_size, group, False)  # noqa: E731
        seed_fn = lambda x: SeedChunkedDistributedLogprob.apply(x, target, start, end, chunk_size, group, False)  # noqa: E731
    results = []
    for fn in (ours_fn, seed_fn):
        shard = full[..., start:end].clone().requires_grad_()
        out = fn(shard)
        out.backward(upstream)
        results.append((out.detach(), shard.grad))
    (ours, ours_grad), (seed, seed_grad) = results
    # Both are fp32 algorithms on N(0, 1) logits: a few ulps of the logsumexp (~7) apart.
    torch.testing.assert_close(ours, seed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_grad, seed_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("world", [2, 3])
def test_matches_seed_algorithm(gloo_pool, world, chunk_size):
    gloo_pool(world).run(_compare_with_seed, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_inference_only_gives_no_graph(chunk_size):
    logits = torch.randn(2, 5, 7, requires_grad=True)
    target = torch.randint(0, 7, (2, 5))
    if chunk_size is None:
        out = cl.DistributedLogprob.apply(logits, target, 0, 7, None, True)
    else:
        out = cl.ChunkedDistributedLogprob.apply(logits, target, 0, 7, chunk_size, None, True)
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.log_softmax(logits.detach(), -1).gather(-1, target[..., None])[..., 0])


def test_shard_bounds_must_match_logits_width():
    logits = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 5))
    with pytest.raises(ValueError, match=r"10 - 0 = 10.*7 vocabulary entries"):
        cl.DistributedLogprob.apply(logits, target, 0, 10, None)


def test_log_softmax_drop_in_is_differentiable():
    """Unlike NeMo-RL's newest (no_grad) version; values and gradients as torch's own."""
    logits = torch.randn(2, 5, 7, requires_grad=True)
    upstream = torch.randn(2, 5, 7)
    ours = cl._compute_distributed_log_softmax(logits, None)
    (ours_grad,) = torch.autograd.grad(ours, logits, upstream)
    ref = torch.log_softmax(logits, -1)
    (ref_grad,) = torch.autograd.grad(ref, logits, upstream)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)


def _gather_logprob_and_entropy_against_oracle(chunk_size: int) -> None:
    """NeMo-RL's newer K-ids and entropy classes, called positionally: values and gradients
    of the float64 oracle (the entropy is NeMo-RL's ``Σ p log p``, minus the entropy)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = vocab_bounds(VOCAB, world, rank)
    gen = torch.Generator().manual_seed(12)
    full = 3 * torch.randn(2, 9, VOCAB, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 9, 4), generator=gen)
    group = dist.group.WORLD
    calls = {
        "ChunkedDistributedGatherLogprob": (
            lambda x: cl.ChunkedDistributedGatherLogprob.apply(
                x, ids, start, end, chunk_size, group, False
            ),
            lambda full: oracle_logprobs(full, ids),
        ),
        "ChunkedDistributedEntropy": (
            lambda x: cl.ChunkedDistributedEntropy.apply(x, chunk_size, group, False),
            lambda full: -oracle_entropy(full),
        ),
    }
    for name, (ours_fn, oracle_fn) in calls.items():
        shard = full[..., start:end].float().requires_grad_()
        oracle_in = full.float().double().requires_grad_()
        ours, expected = ours_fn(shard), oracle_fn(oracle_in)
        upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
        ours.backward(upstream.float())
        expected.backward(upstream)
        assert ours.dtype == torch.float32 and ours.shape == expected.shape, name
        # fp32 math on logits of scale 3: a few ulps of the row's logsumexp (~12).
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(
            shard.grad.double(), oracle_in.grad[..., start:end], rtol=1e-5, atol=1e-5, msg=name
        )


@pytest.mark.parametrize("world", [2, 3])
def test_gather_logprob_and_entropy_match_oracle(gloo_pool, world):
    gloo_pool(world).run(_gather_logprob_and_entropy_against_oracle, 4)


def test_gather_logprob_and_entropy_inference_only_give_no_graph():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5, 3))
    outs = (
        cl.ChunkedDistributedGatherLogprob.apply(logits, ids, 0, 7, 2, None, True),
        cl.ChunkedDistributedEntropy.apply(logits, 2, None, True),
    )
    assert not any(out.requires_grad for out in outs)


@pytest.mark.parametrize(
    "params", [None, SamplingParams(), SamplingParams(top_k=-1, temperature=0.5)], ids=str
)
def test_unfiltered_sampling_params_change_nothing(params):
    """Passed positionally where NeMo-RL takes them; the temperature is the caller's to apply,
    as in NeMo-RL's functions."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 6), generator=gen)
    cu = torch.tensor([0, 2, 6])
    plain = cl.from_parallel_logits_to_logprobs(logits, ids, 0, 7, None, False, None, 2, params)
    packed = cl.from_parallel_logits_to_logprobs_packed_sequences(
        logits[:1], ids[:1], cu, 4, 0, 7, None, False, None, None, params
    )
    local = cl.dtensor_from_parallel_logits_to_logprobs(
        logits, ids, 0, 7, None, False, None, None, params
    )
    torch.testing.assert_close(plain, cl.context_parallel_logprobs(logits, ids))
    torch.testing.assert_close(local, plain)
    torch.testing.assert_close(
        packed, cl.packed_context_parallel_logprobs(logits[:1], ids[:1], cu, max_seqlen=4)
    )


def _next_token_logprobs_against_oracle() -> None:
    """NeMo-RL's dispatching helper on plain vocab-parallel logits (even shards, as it
    assumes), called positionally: the oracle's next-token log-probs and gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = VOCAB - VOCAB % world
    width = vocab // world
    gen = torch.Generator().manual_seed(13)
    full = torch.randn(2, 9, vocab, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 9), generator=gen)
    shard = full[..., rank * width : (rank + 1) * width].float().requires_grad_()
    ours = cl.get_next_token_logprobs_from_logits(
        ids, shard, None, rank, dist.group.WORLD, None, None, 4
    )
    oracle_in = full.float().double().requires_grad_()
    expected = oracle_logprobs(oracle_in[:, :-1], ids[:, 1:])
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    ours.backward(upstream.float())
    expected.backward(upstream)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        shard.grad.double(), oracle_in.grad[..., rank * width : (rank + 1) * width],
        rtol=1e-5, atol=1e-6,
    )


def test_next_token_logprobs_vocab_parallel_matches_oracle(gloo_pool):
    gloo_pool(2).run(_next_token_logprobs_against_oracle)


def test_next_token_logprobs_unsharded():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 6), generator=gen)
    torch.testing.assert_close(
        cl.get_next_token_logprobs_from_logits(ids, logits),
        torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0],
    )


def _raw_logits_against_full() -> None:
    """NeMo-RL's raw-logit helpers on uneven shards: the global top-k logits and ids of the
    full logits, exactly; the logits at K global ids, exactly, each rank's shard receiving
    the upstream gradient at the ids it owns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = vocab_bounds(VOCAB, world, rank)
    gen = torch.Generator().manual_seed(14)
    full = torch.randn(2, 9, VOCAB, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9, 5), generator=gen)
    group = dist.group.WORLD
    shard = full[..., start:end].clone().requires_grad_()

    values, top_ids = cl.distributed_vocab_topk(
        shard, 6, group, vocab_start_index=start, vocab_end_index=end, chunk_size=4
    )
    assert not values.requires_grad and values.dtype == torch.float32
    assert torch.equal(values, full.float().topk(6).values)
    # bf16 logits tie: any ids of the top values will do, each once.
    assert torch.equal(full.float().gather(-1, top_ids), values)
    assert (top_ids.sort(-1).values.diff(dim=-1) > 0).all()

    picked = cl.gather_logits_at_global_indices(
        shard, ids, group, vocab_start_index=start, vocab_end_index=end
    )
    assert picked.dtype == torch.float32
    assert torch.equal(picked, full.float().gather(-1, ids))
    upstream = torch.randn(picked.shape, generator=gen)
    picked.backward(upstream)
    expected_grad = torch.zeros(full.shape).scatter_add_(-1, ids, upstream)[..., start:end]
    torch.testing.assert_close(shard.grad.float(), expected_grad.to(torch.bfloat16).float())


@pytest.mark.parametrize("world", [2, 3])
def test_raw_logit_helpers_match_full_logits(gloo_pool, world):
    gloo_pool(world).run(_raw_logits_against_full)


def test_distillation_topk_logprobs_unsharded():
    """Unsharded logits without CP: the student's log-probs at the teacher's ids over the full
    vocabulary or renormalised over them, the teacher's renormalised, the last position
    dropped; bad options are refused."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 11, generator=gen)
    ids = torch.randint(0, 11, (2, 6, 3), generator=gen)
    teacher = torch.randn(2, 6, 3, generator=gen)
    student, teacher_logprobs, neg_entropy = cl.get_distillation_topk_logprobs_from_logits(
        logits, teacher, ids, True, True
    )
    log_q = torch.log_softmax(logits, -1)
    torch.testing.assert_close(student, log_q.gather(-1, ids)[:, :-1])
    torch.testing.assert_close(teacher_logprobs, torch.log_softmax(teacher, -1)[:, :-1])
    torch.testing.assert_close(neg_entropy, (log_q.exp() * log_q).sum(-1)[:, :-1])
    renormalised, _, none = cl.get_distillation_topk_logprobs_from_logits(
        logits, teacher, ids, False, False
    )
    torch.testing.assert_close(renormalised, logits.gather(-1, ids).log_softmax(-1)[:, :-1])
    assert none is None
    with pytest.raises(ValueError, match="calculate_entropy=True needs zero_outside_topk=True"):
        cl.get_distillation_topk_logprobs_from_logits(logits, teacher, ids, False, True)
    with pytest.raises(ValueError, match=r"K >= 1, got shape \(2, 6, 0\)"):
        cl.get_distillation_topk_logprobs_from_logits(logits, teacher, ids[..., :0], True, False)
    with pytest.raises(ValueError, match=r"teacher_topk_logits \(2, 6, 2\) must have the shape"):
        cl.get_distillation_topk_logprobs_from_logits(logits, teacher[..., :2], ids, True, False)
    with pytest.raises(ValueError, match="vocab_parallel_rank must be given"):
        cl.get_distillation_topk_logprobs_from_logits(
            logits, teacher, ids, True, False, vocab_parallel_group=object()
        )


def _small_helpers() -> None:
    """NeMo-RL's small collective helpers on the world group as TP (even shards) or CP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(21)
    full = torch.randn(2, 4, 6 * world, generator=gen)
    width = full.shape[-1] // world
    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()

    assert torch.equal(cl.vocab_parallel_argmax(shard, tp_group=group), full.argmax(-1))
    columns = torch.tensor([0, 5, 6 * world - 1, 5])
    picked = cl.vocab_parallel_gather_columns(shard, columns, tp_group=group)
    assert torch.equal(picked, full[..., columns])
    picked.sum().backward()
    counts = torch.zeros(full.shape[-1]).index_add_(0, columns, torch.ones(4))
    assert torch.equal(shard.grad, counts[rank * width : (rank + 1) * width].expand_as(shard))

    x = torch.full((3,), float(rank + 1), requires_grad=True)
    total = cl.group_all_reduce_sum_with_grad(x, group)
    assert torch.equal(total, torch.full((3,), world * (world + 1) / 2))
    total.backward(torch.full((3,), 2.0))
    assert torch.equal(x.grad, torch.full((3,), 2.0))  # identity, no all-reduce
    assert not cl.group_all_reduce_sum(x, group).requires_grad

    rows = full.flatten(0, 1)  # [BS, V], BS = 8
    if rows.shape[0] % world == 0:
        local_rows = rows.shape[0] // world
        mine = cl.all_to_all_vp2sq(rows[:, rank * width : (rank + 1) * width], group)
        assert torch.equal(mine, rows[rank * local_rows : (rank + 1) * local_rows])
        back = cl.all_to_all_sq2vp(mine, group)
        assert torch.equal(back, rows[:, rank * width : (rank + 1) * width])
        # The ones the compile contract's entry points leave out trace whole too.
        round_trip = torch.compile(
            lambda z: cl.all_to_all_sq2vp(cl.all_to_all_vp2sq(z, group), group), fullgraph=True
        )
        assert torch.equal(round_trip(back), back)

    # CP: the world's load-balanced shards of a [2, 4 · world, 3] sequence.
    seq = torch.randn(2, 4 * world, 3, generator=gen)
    balanced = cl.shard_for_context_parallel(seq, group=group).clone().requires_grad_()
    contiguous = cl.cp_load_balanced_to_contiguous(balanced, cp_group=group)
    assert torch.equal(contiguous, seq[:, 4 * rank : 4 * (rank + 1)])
    compiled = torch.compile(cl.cp_load_balanced_to_contiguous, fullgraph=True)
    compiled(balanced, cp_group=group).sum().backward()
    assert torch.equal(balanced.grad, torch.ones_like(balanced))  # each position once
    window = seq[:, 4 * rank : 4 * (rank + 1)].clone().requires_grad_()
    shifted = cl.cp_shift_next(window, group, fill=-1.0)
    expected = torch.cat([seq[:, 1:], torch.full_like(seq[:, :1], -1.0)], 1)
    assert torch.equal(shifted, expected[:, 4 * rank : 4 * (rank + 1)])
    shifted.sum().backward()
    assert torch.equal(window.grad[:, 0], torch.zeros_like(window.grad[:, 0]))
    assert torch.equal(window.grad[:, 1:], torch.ones_like(window.grad[:, 1:]))


@pytest.mark.parametrize("world", [2, 3])
def test_small_helpers(gloo_pool, world):
    gloo_pool(world).run(_small_helpers)


def test_small_helpers_without_a_group():
    logits = torch.randn(2, 3, 7)
    assert torch.equal(cl.vocab_parallel_argmax(logits), logits.argmax(-1))
    columns = torch.tensor([6, 0])
    assert torch.equal(cl.vocab_parallel_gather_columns(logits, columns), logits[..., columns])
    x = torch.randn(4)
    assert cl.group_all_reduce_sum_with_grad(x, None) is x
    assert torch.equal(cl.all_to_all_vp2sq(x.view(2, 2), None), x.view(2, 2))
    assert torch.equal(cl.cp_load_balanced_to_contiguous(logits), logits)
    shifted = cl.cp_shift_next(logits, fill=0.0)
    assert torch.equal(shifted, torch.cat([logits[:, 1:], torch.zeros_like(logits[:, :1])], 1))
    with pytest.raises(ValueError, match=r"column_indices must be \[K\]"):
        cl.vocab_parallel_gather_columns(logits, columns.view(1, 2))
