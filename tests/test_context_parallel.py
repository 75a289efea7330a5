"""Context parallelism, packed sequences and DTensor entry points against the float64 oracle.

Every case builds the same full (natural-order, full-vocabulary) logits and token ids on
every rank from one seed, cuts out the rank's part with the tests' own chunk-and-concat
reference of the load-balanced layout (``helpers.ref_shard``, independent of the library's
index maps), and compares the rank's output with the oracle's. Gradients: each rank
backpropagates its own upstream gradient; the CP gather's backward must hand each rank the
sum over its CP group of the upstream gradients at its positions, so the expected logits
gradient is the oracle's under that summed upstream, cut out like the logits.

Ranks are laid out on a ``("cp", "tp")`` device mesh; grids are ``(tp, cp)``.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import CP_BATCH, IGNORE, cp_layout, ref_shard, ref_shard_packed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_logprob import context_parallel as cp_api
from compiled_logprob import dtensor as dt_api
from compiled_logprob import packed as packed_api
from compiled_logprob import nemo_compat as nemo
from compiled_logprob.testing.reference import oracle_entropy, oracle_logprobs, vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]  # (tp, cp)
VOCAB = 97
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Keyword options beyond the drop-ins': None (none), "float" (ignore_index, temperature 0.7),
# "position" (ignore_index, a per-position temperature tensor, return_entropy).
EXTRAS = (None, "float", "position")


# --- helpers, run inside the gloo workers ------------------------------------------------


def _rolled_within(ids: torch.Tensor, bounds) -> torch.Tensor:
    """A packed row's ids rolled left by one within each sequence (NeMo-RL's pre-rolling)."""
    return torch.cat([ids[s:e].roll(-1) for s, e in bounds])


def _upstreams(shape, seed: int, tp_rank: int, cp_rank: int, cp: int):
    """This rank's upstream gradient and the sum of those of its CP group (same tp_rank)."""
    grads = [
        torch.randn(
            shape,
            generator=torch.Generator().manual_seed(seed * 97 + tp_rank * 13 + c),
            dtype=torch.float64,
        )
        for c in range(cp)
    ]
    return grads[cp_rank], sum(grads)


def _extras(kind: str | None, ids: torch.Tensor, out_shape, gen):
    """``(ids, options)``: with ``kind``, ~30% of ``ids`` are IGNORE and ``options`` are the
    keyword options of :data:`EXTRAS` (a per-position temperature of the output's shape)."""
    if kind is None:
        return ids, {}
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, IGNORE, ids)
    if kind == "float":
        return ids, dict(ignore_index=IGNORE, temperature=0.7)
    temperature = 0.5 + 1.5 * torch.rand(out_shape, generator=gen)
    return ids, dict(ignore_index=IGNORE, temperature=temperature, return_entropy=True)


def _stacked(out) -> torch.Tensor:
    """``(logprobs, entropy)`` as one ``[2, ...]`` tensor; log-probs alone as they are."""
    return torch.stack(out) if isinstance(out, tuple) else out


def _oracle_next_token(
    full: torch.Tensor, ids: torch.Tensor, options: dict, next_token: bool = True
) -> torch.Tensor:
    """The float64 oracle of next-token log-probs (stacked with the entropy where asked) of
    natural-order ``full`` ``[..., S, V]`` and ``ids`` ``[..., S]``: ``[(2,) ..., S - 1]``;
    without ``next_token``, of each position's own id: ``[(2,) ..., S]``."""
    logits, targets = (full[..., :-1, :], ids[..., 1:]) if next_token else (full, ids)
    temperature = options.get("temperature", 1.0)
    logprobs = oracle_logprobs(logits, targets, options.get("ignore_index"), temperature)
    if not options.get("return_entropy"):
        return logprobs
    entropy = torch.where(targets == IGNORE, 0.0, oracle_entropy(logits, temperature))
    return torch.stack([logprobs, entropy])


def _assert_matches(out, expected, grad, expected_grad, upstream_sum, dtype) -> None:
    assert out.dtype == torch.float32 and out.shape == expected.shape, (out.shape, expected.shape)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # fp32 math, then the gradient's rounding into the logits' dtype.
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-8
    atol = 1e-6 * float(upstream_sum.abs().max())
    assert grad.dtype == dtype and grad.shape == expected_grad.shape, (
        grad.shape,
        expected_grad.shape,
    )
    torch.testing.assert_close(grad.double(), expected_grad, rtol=rtol, atol=atol)


def _cp_logprobs(api, logits, ids, lo, hi, tp_group, cp_group, chunk, next_token, **options):
    if api == "context_parallel_logprobs":
        return cp_api.context_parallel_logprobs(
            logits,
            ids,
            vocab_start=lo,
            group=tp_group,
            cp_group=cp_group,
            chunk_size=chunk,
            next_token=next_token,
            **options,
        )
    return nemo.from_parallel_logits_to_logprobs(
        logits, ids, lo, hi, tp_group, cp_group=cp_group, chunk_size=chunk,
        shift_targets=next_token,
    )


def _check_cp(tp, cp, api, seq, chunk, dtype_name, seed=0, extras=None, next_token=True):
    _, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    dtype = DTYPES[dtype_name]
    local_len = 2 * -(-seq // (2 * cp))  # room for S, load-balanced chunks
    gen = torch.Generator().manual_seed(seed)
    shape = (CP_BATCH, local_len * cp, VOCAB)
    full = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    ids = torch.randint(0, VOCAB, (CP_BATCH, seq), generator=gen)
    ids, options = _extras(extras, ids, (CP_BATCH, seq - next_token), gen)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    logits = ref_shard(full, cp_rank, cp, 1)[..., lo:hi].clone().requires_grad_()

    out = _stacked(
        _cp_logprobs(api, logits, ids, lo, hi, tp_group, cp_group, chunk, next_token, **options)
    )
    oracle_in = full.double().requires_grad_()
    expected = _oracle_next_token(oracle_in[:, :seq], ids, options, next_token)
    upstream, upstream_sum = _upstreams(expected.shape, seed, tp_rank, cp_rank, cp)
    (expected * upstream_sum).sum().backward()
    (out * upstream.float()).sum().backward()
    expected_grad = ref_shard(oracle_in.grad, cp_rank, cp, 1)[..., lo:hi]
    _assert_matches(out, expected, logits.grad, expected_grad, upstream_sum, dtype)


def _packed_layout(lengths, cp, seed, cu_dtype):
    """Full packed logits ``[T, V]``, ids ``[T]`` and ``cu_seqlens_padded`` for sequences of
    ``lengths`` real tokens, each padded to a multiple of ``2 * cp`` under CP."""
    unit = 2 * cp if cp > 1 else 1  # without CP, odd lengths need no padding
    padded = [-(-n // unit) * unit for n in lengths]
    cu = torch.tensor([0, *itertools.accumulate(padded)], dtype=cu_dtype)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(int(cu[-1]), VOCAB, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (int(cu[-1]),), generator=gen)
    return full, ids, cu


def _packed_oracle(full, ids, cu, max_seqlen, options=None, next_token=True):
    """``[(2,) B, max_seqlen - 1]``: each sequence's next-token oracle, cut and zero-padded; a
    tensor temperature is ``[B, max_seqlen - 1]`` (without ``next_token``, ``max_seqlen``
    columns of each position's own id)."""
    options = options or {}
    shift = int(next_token)
    rows = []
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        kept = max(0, min(end - start, max_seqlen) - shift)  # positions left after the cut
        row_options = dict(options)
        if isinstance(options.get("temperature"), torch.Tensor):
            row_options["temperature"] = options["temperature"][i, :kept]
        window = slice(start, start + kept + shift)
        row = _oracle_next_token(full[window], ids[window], row_options, next_token)
        rows.append(torch.nn.functional.pad(row, (0, max_seqlen - shift - kept)))
    return torch.stack(rows, dim=-2)


def _packed_logprobs(
    api, logits, ids, cu, max_seqlen, lo, hi, tp_group, cp_group, chunk, next_token, **options
):
    if api == "packed_context_parallel_logprobs":
        return packed_api.packed_context_parallel_logprobs(
            logits,
            ids,
            cu,
            max_seqlen=max_seqlen,
            vocab_start=lo,
            group=tp_group,
            cp_group=cp_group,
            chunk_size=chunk,
            next_token=next_token,
            **options,
        )
    return nemo.from_parallel_logits_to_logprobs_packed_sequences(
        logits, ids, cu, max_seqlen, lo, hi, tp_group, cp_group=cp_group, chunk_size=chunk,
        target_is_pre_rolled=api == "pre_rolled",
    )


def _check_packed(
    tp, cp, api, lengths, max_seqlen, chunk, cu_dtype, seed=0, extras=None, next_token=True
):
    """``api="pre_rolled"``: the drop-in given this rank's targets, rolled within each
    sequence and CP-sharded like the logits (NeMo-RL's ``target_is_pre_rolled``)."""
    _, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    full, ids, cu = _packed_layout(lengths, cp, seed, cu_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    ids, options = _extras(extras, ids, (len(lengths), max_seqlen - next_token), gen)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    local = ref_shard_packed(full, bounds, cp_rank, cp)
    logits = local[None, :, lo:hi].float().requires_grad_()
    given = ids
    if api == "pre_rolled":
        given = ref_shard_packed(_rolled_within(ids, bounds), bounds, cp_rank, cp)

    out = _stacked(
        _packed_logprobs(
            api, logits, given[None], cu, max_seqlen, lo, hi, tp_group, cp_group, chunk,
            next_token, **options,
        )
    )
    oracle_in = full.float().double().requires_grad_()
    expected = _packed_oracle(oracle_in, ids, cu, max_seqlen, options, next_token)
    upstream, upstream_sum = _upstreams(expected.shape, seed, tp_rank, cp_rank, cp)
    (expected * upstream_sum).sum().backward()
    (out * upstream.float()).sum().backward()
    expected_grad = ref_shard_packed(oracle_in.grad, bounds, cp_rank, cp)
    _assert_matches(
        out, expected, logits.grad, expected_grad[None, :, lo:hi], upstream_sum, torch.float32
    )


def _check_options(tp, cp):
    """ignore_index, temperature and return_entropy through every CP entry point (padding
    included: S = 13 and 11 need it, and so do the packed lengths)."""
    seq = 13 if cp < 4 else 11
    for extras, chunk in itertools.product(EXTRAS[1:], (None, 3)):
        _check_cp(tp, cp, "context_parallel_logprobs", seq, chunk, "fp32", seed=2, extras=extras)
        _check_packed(
            tp, cp, "packed_context_parallel_logprobs", (5, 0, 9, 1, 3), 7, chunk, torch.int64,
            seed=2, extras=extras,
        )
        _check_dtensor(tp, cp, "dtensor_logprobs", 12 if cp < 4 else 16, chunk, 2, extras)


def _check_unshifted_and_pre_rolled(tp, cp):
    """``next_token=False`` (NeMo-RL's ``shift_targets=False``) through every CP entry point,
    and the packed drop-in's pre-rolled targets (``target_is_pre_rolled``)."""
    seq = 13 if cp < 4 else 11
    for (api, extras), chunk in itertools.product(
        (
            ("context_parallel_logprobs", None),
            ("context_parallel_logprobs", "position"),
            ("from_parallel_logits_to_logprobs", None),
        ),
        (None, 3),
    ):
        _check_cp(tp, cp, api, seq, chunk, "fp32", seed=3, extras=extras, next_token=False)
    lengths = (5, 0, 9, 1, 3)
    for max_seqlen, extras in ((7, None), (20, "position")):
        _check_packed(
            tp, cp, "packed_context_parallel_logprobs", lengths, max_seqlen, 3, torch.int64,
            seed=3, extras=extras, next_token=False,
        )
        _check_packed(tp, cp, "pre_rolled", lengths, max_seqlen, None, torch.int32, seed=3)
    for api, extras in (
        ("dtensor_logprobs", "position"),
        ("dtensor_from_parallel_logits_to_logprobs", None),
    ):
        _check_dtensor(tp, cp, api, 12 if cp < 4 else 16, None, 3, extras, next_token=False)


def _dtensor_vocab_bounds(tp_rank: int, tp: int) -> tuple[int, int]:
    """DTensor's Shard semantics (torch.chunk), unlike vocab_bounds: 97 over 4 is 25,25,25,22."""
    sizes = [len(c) for c in torch.arange(VOCAB).chunk(tp)]
    return sum(sizes[:tp_rank]), sum(sizes[: tp_rank + 1])


def _check_dtensor(tp, cp, api, seq, chunk, seed=0, extras=None, next_token=True):
    mesh, tp_group, _, tp_rank, cp_rank = cp_layout(tp, cp)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(CP_BATCH, seq, VOCAB, generator=gen, dtype=torch.float64).float()
    ids = torch.randint(0, VOCAB, (CP_BATCH, seq), generator=gen)
    ids, options = _extras(extras, ids, (CP_BATCH, seq - next_token), gen)
    # Any permutation will do: seq_index[k] is the natural position of CP-ordered position k.
    seq_index = torch.randperm(seq, generator=gen) if cp > 1 else torch.arange(seq)
    ordered, ordered_ids = full[:, seq_index], ids[:, seq_index]
    local_len = seq // cp
    rows = slice(cp_rank * local_len, (cp_rank + 1) * local_len)
    given_index = seq_index if cp > 1 else None

    if api == "dtensor_from_parallel_logits_to_logprobs":
        lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
        logits = ordered[:, rows, lo:hi].clone().requires_grad_()
        target = distribute_tensor(ordered_ids, mesh["cp"], [Shard(1)])
        out = nemo.dtensor_from_parallel_logits_to_logprobs(
            logits, target, lo, hi, tp_group, seq_index=given_index, chunk_size=chunk,
            shift_targets=next_token,
        )
        grad = lambda: logits.grad
    else:
        lo, hi = _dtensor_vocab_bounds(tp_rank, tp)
        logits = distribute_tensor(ordered, mesh, [Shard(1), Shard(2)]).requires_grad_()
        target = distribute_tensor(ordered_ids, mesh, [Shard(1), Replicate()])
        if api == "dtensor_logprobs":
            out = _stacked(
                dt_api.dtensor_logprobs(
                    logits, target, seq_index=given_index, chunk_size=chunk,
                    next_token=next_token, **options,
                )
            )
        elif api == "get_next_token_logprobs_from_logits":
            assert next_token, f"{api} always shifts"
            out = nemo.get_next_token_logprobs_from_logits(
                target, logits, given_index, chunk_size=chunk
            )
        else:
            assert next_token, f"{api} always shifts"
            out = nemo.get_logprobs_from_vocab_parallel_logits(logits, target, given_index, chunk)
        assert dt_api.vocab_shard_bounds(logits) == (lo, hi)
        grad = lambda: logits.grad.to_local()

    oracle_in = full.double().requires_grad_()
    expected = _oracle_next_token(oracle_in, ids, options, next_token)
    upstream, upstream_sum = _upstreams(expected.shape, seed, tp_rank, cp_rank, cp)
    (expected * upstream_sum).sum().backward()
    (out * upstream.float()).sum().backward()
    expected_grad = oracle_in.grad[:, seq_index][:, rows, lo:hi]
    _assert_matches(out, expected, grad(), expected_grad, upstream_sum, torch.float32)


def _check_gather(tp, cp, seed=0):
    _, _, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 4 * cp, 2, generator=gen, dtype=torch.float64)
    gathers = {
        "gather_context_parallel": lambda x, d: cp_api.gather_context_parallel(
            x, group=cp_group, dim=d
        ),
        "AllGatherCPTensor": lambda x, d: nemo.AllGatherCPTensor.apply(x, cp_group, d),
        "allgather_cp_sharded_tensor": lambda x, d: nemo.allgather_cp_sharded_tensor(
            x, cp_group, seq_dim=d
        ),
    }
    for (name, gather), dim in itertools.product(gathers.items(), (1, -2, 0)):
        x = full.movedim(1, dim)
        local = ref_shard(x, cp_rank, cp, dim).clone().requires_grad_()
        out = gather(local, dim)
        assert torch.equal(out, x), (name, dim)
        upstream, upstream_sum = _upstreams(x.shape, seed, tp_rank, cp_rank, cp)
        out.backward(upstream)
        torch.testing.assert_close(
            local.grad, ref_shard(upstream_sum, cp_rank, cp, dim), msg=f"{name} dim={dim}"
        )
    shard = cp_api.shard_for_context_parallel(full, group=cp_group, dim=1)
    assert torch.equal(shard, ref_shard(full, cp_rank, cp, 1))

    # cp_group=None: as NeMo-RL, the default (WORLD) group, here of all tp * cp ranks.
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(3, 4 * world, 2, generator=gen, dtype=torch.float64)
    upstreams = [
        torch.randn(full.shape, generator=torch.Generator().manual_seed(50 + r), dtype=full.dtype)
        for r in range(world)
    ]
    for name, gather in (
        ("AllGatherCPTensor", lambda x: nemo.AllGatherCPTensor.apply(x, None)),
        ("allgather_cp_sharded_tensor", lambda x: nemo.allgather_cp_sharded_tensor(x, None, 1)),
    ):
        local = ref_shard(full, rank, world, 1).clone().requires_grad_()
        out = gather(local)
        assert torch.equal(out, full), name
        out.backward(upstreams[rank])
        torch.testing.assert_close(
            local.grad, ref_shard(sum(upstreams), rank, world, 1), msg=f"{name} cp_group=None"
        )


def _check_gather_logits(tp, cp, seed=0):
    """NeMo-RL's ``gather_logits_at_global_indices``: the full logits at K global ids per
    position, exactly; a rank's logits receive, at its positions and the ids it owns, the
    sum over its CP group of the upstream gradients (S = 13 and 11 need padding)."""
    _, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    seq = 13 if cp < 4 else 11
    local_len = 2 * -(-seq // (2 * cp))
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(CP_BATCH, local_len * cp, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (CP_BATCH, seq, 3), generator=gen)
    logits = ref_shard(full, cp_rank, cp, 1)[..., lo:hi].clone().requires_grad_()
    out = nemo.gather_logits_at_global_indices(
        logits, ids, tp_group, cp_group, vocab_start_index=lo, vocab_end_index=hi
    )
    assert torch.equal(out, full[:, :seq].gather(-1, ids))
    upstream, upstream_sum = _upstreams(out.shape, seed, tp_rank, cp_rank, cp)
    out.backward(upstream.float())
    expected = torch.zeros(full.shape, dtype=torch.float64)
    expected[:, :seq].scatter_add_(-1, ids, upstream_sum)
    # The CP gather's backward sums fp32 gradients over the CP group.
    torch.testing.assert_close(
        logits.grad.double(), ref_shard(expected, cp_rank, cp, 1)[..., lo:hi],
        rtol=1e-5, atol=1e-6,
    )


def _check_distillation(tp, cp, seed=3):
    """NeMo-RL's ``get_distillation_topk_logprobs_from_logits`` on plain and DTensor student
    logits: the student's log-probs at the teacher's K ids over the full vocabulary (with the
    negative entropy) or renormalised over the K, the teacher's renormalised, all without the
    last position; the student's gradient as the CP gather's backward sums it."""
    mesh, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    seq = 13 if cp < 4 else 11
    # Without CP the logits hold the S positions; with it, S padded to a multiple of 2·CP.
    local_len = seq if cp == 1 else 2 * -(-seq // (2 * cp))
    gen = torch.Generator().manual_seed(seed)
    full = 3 * torch.randn(CP_BATCH, local_len * cp, VOCAB, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (CP_BATCH, seq, 3), generator=gen)
    teacher = torch.randn(CP_BATCH, seq, 3, generator=gen)
    expected_teacher = torch.log_softmax(teacher.double(), -1)[:, :-1]
    # DTensor shards the vocabulary as torch.chunk does: even shards, so VOCAB - 1 ids.
    even = VOCAB - VOCAB % tp
    for layout, zero_outside, entropy in itertools.product(
        ("megatron", "dtensor", "unsharded"), (True, False), (True, False)
    ):
        if (entropy and not zero_outside) or (layout == "unsharded" and tp > 1):
            continue
        where = f"{layout} zero_outside_topk={zero_outside} entropy={entropy} tp{tp}xcp{cp}"
        width = -(-even // tp) if layout != "unsharded" else VOCAB
        vocab = even if layout != "unsharded" else VOCAB
        start = min(vocab, tp_rank * width)
        full_leaf = full[..., :vocab].clone().requires_grad_()
        local = ref_shard(full_leaf.detach(), cp_rank, cp, 1)[..., start : start + width]
        local = local.float().clone().requires_grad_()
        args = (local, teacher, ids % vocab, zero_outside, entropy)
        if layout == "megatron":
            out = nemo.get_distillation_topk_logprobs_from_logits(
                *args, tp_rank, tp_group, cp_group
            )
        elif layout == "dtensor":
            sharded = DTensor.from_local(local, mesh, [Shard(1), Shard(2)], run_check=False)
            out = nemo.get_distillation_topk_logprobs_from_logits(sharded, *args[1:])
        else:
            out = nemo.get_distillation_topk_logprobs_from_logits(
                *args, context_parallel_group=cp_group
            )
        student, teacher_logprobs, neg_entropy = out
        torch.testing.assert_close(teacher_logprobs.double(), expected_teacher, msg=where)
        log_q = torch.log_softmax(full_leaf[:, :seq], -1)
        if zero_outside:
            expected = log_q.gather(-1, ids % vocab)[:, :-1]
        else:
            expected = full_leaf[:, :seq].gather(-1, ids % vocab).log_softmax(-1)[:, :-1]
        torch.testing.assert_close(student.double(), expected, rtol=1e-5, atol=1e-5, msg=where)
        upstream, upstream_sum = _upstreams(student.shape, seed, tp_rank, cp_rank, cp)
        loss, expected_loss = (student * upstream).sum(), (expected * upstream_sum).sum()
        if entropy:
            expected_neg = (log_q.exp() * log_q).sum(-1)[:, :-1]
            torch.testing.assert_close(neg_entropy.double(), expected_neg, rtol=1e-5, atol=1e-5, msg=where)
            loss, expected_loss = loss + neg_entropy.sum(), expected_loss + cp * expected_neg.sum()
        else:
            assert neg_entropy is None, where
        loss.backward()
        expected_loss.backward()
        expected_grad = ref_shard(full_leaf.grad, cp_rank, cp, 1)[..., start : start + width]
        torch.testing.assert_close(local.grad.double(), expected_grad, rtol=1e-5, atol=1e-5, msg=where)


def _check_edge_cases(tp, cp):
    """Empty input and ids that are never scored, under this grid's CP: S = 0 gives
    ``[B, 0]``; an empty packed row gives zeros; ``input_ids[..., 0]`` (in a packed row,
    each sequence's first token) may be anything, e.g. -1."""
    _, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)

    def plain(logits, ids, **options):
        return cp_api.context_parallel_logprobs(
            logits, ids, vocab_start=lo, group=tp_group, cp_group=cp_group, **options
        )

    def packed(logits, ids, cu, max_seqlen, **options):
        return packed_api.packed_context_parallel_logprobs(
            logits, ids, cu, max_seqlen=max_seqlen, vocab_start=lo, group=tp_group,
            cp_group=cp_group, **options,
        )

    # S = 0, with 2 (padding) positions on each rank.
    logits = torch.randn(CP_BATCH, 2, hi - lo, requires_grad=True)
    ids = torch.zeros(CP_BATCH, 0, dtype=torch.long)
    outs = (
        *plain(logits, ids, return_entropy=True),
        nemo.from_parallel_logits_to_logprobs(logits, ids, lo, hi, tp_group, cp_group=cp_group),
    )
    assert all(out.shape == (CP_BATCH, 0) for out in outs), [out.shape for out in outs]
    sum(out.sum() for out in outs).backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))

    # An empty packed row.
    logits = torch.randn(1, 0, hi - lo, requires_grad=True)
    ids, cu = torch.zeros(1, 0, dtype=torch.long), torch.tensor([0, 0])
    outs = (
        *packed(logits, ids, cu, 5, return_entropy=True),
        nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu, 5, lo, hi, tp_group, cp_group=cp_group
        ),
    )
    assert all(torch.equal(out, torch.zeros(1, 4)) for out in outs), outs
    sum(out.sum() for out in outs).backward()
    assert logits.grad.shape == logits.shape

    # Unscored ids: -1 where input_ids[..., 0] is (S = 2 * cp * 3 - 1 needs padding).
    gen = torch.Generator().manual_seed(5)
    full_plain = torch.randn(CP_BATCH, 6 * cp, VOCAB, generator=gen)
    logits = ref_shard(full_plain, cp_rank, cp, 1)[..., lo:hi]
    ids = torch.randint(0, VOCAB, (CP_BATCH, 6 * cp - 1), generator=gen)
    ids_bad = ids.clone()
    ids_bad[:, 0] = -1
    assert torch.equal(plain(logits, ids_bad), plain(logits, ids))
    full, packed_ids, cu = _packed_layout((5, 0, 9, 1), cp, 5, torch.int64)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    logits = ref_shard_packed(full, bounds, cp_rank, cp)[None, :, lo:hi]
    ids_bad = packed_ids.clone()
    ids_bad[[s for s, e in bounds if e > s]] = -1
    logits = logits.float()
    expected = packed(logits, packed_ids[None], cu, 8)
    assert torch.equal(packed(logits, ids_bad[None], cu, 8), expected)

    # numpy ints, vocab_start > 0 under TP: the same results as Python ints.
    assert torch.equal(
        nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, packed_ids[None], cu, np.int64(8), np.int64(lo), np.int64(hi), tp_group,
            cp_group=cp_group, chunk_size=np.int32(3),
        ),
        expected,
    )
    logits = ref_shard(full_plain, cp_rank, cp, 1)[..., lo:hi]
    assert torch.equal(
        nemo.from_parallel_logits_to_logprobs(
            logits, ids, np.int64(lo), np.int64(hi), tp_group, cp_group=cp_group,
            chunk_size=np.int64(3),
        ),
        plain(logits, ids),
    )


def _check_grid(tp, cp):
    """The whole numerics battery of one grid, in one round trip to the pool."""
    seq = 13 if cp < 4 else 11  # both need padding
    for api, (chunk, dtype) in itertools.product(
        ("context_parallel_logprobs", "from_parallel_logits_to_logprobs"),
        ((None, "fp32"), (3, "fp32"), (None, "bf16")),
    ):
        _check_cp(tp, cp, api, seq, chunk, dtype)
    _check_cp(
        tp, cp, "from_parallel_logits_to_logprobs", 2 * cp * 3, None, "fp32", seed=1
    )  # no padding
    lengths = (5, 0, 9, 1, 3)
    for api, chunk, (max_seqlen, cu_dtype) in itertools.product(
        ("packed_context_parallel_logprobs", "from_parallel_logits_to_logprobs_packed_sequences"),
        (None, 5),
        ((7, torch.int32), (20, torch.int64)),
    ):
        _check_packed(tp, cp, api, lengths, max_seqlen, chunk, cu_dtype)
    for api, chunk in itertools.product(
        (
            "dtensor_from_parallel_logits_to_logprobs",
            "get_logprobs_from_vocab_parallel_logits",
            "get_next_token_logprobs_from_logits",
            "dtensor_logprobs",
        ),
        (None, 3),
    ):
        _check_dtensor(tp, cp, api, 12 if cp < 4 else 16, chunk)
    _check_gather(tp, cp)
    _check_gather_logits(tp, cp)
    _check_distillation(tp, cp)
    _check_edge_cases(tp, cp)


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp,cp", GRIDS, ids=[f"tp{tp}xcp{cp}" for tp, cp in GRIDS])
def test_matches_oracle(gloo_pool, tp, cp):
    gloo_pool(tp * cp).run(_check_grid, tp, cp)


@pytest.mark.parametrize("tp,cp", GRIDS, ids=[f"tp{tp}xcp{cp}" for tp, cp in GRIDS])
def test_options(gloo_pool, tp, cp):
    """ignore_index, a float or per-position temperature and the entropy, forward and backward."""
    gloo_pool(tp * cp).run(_check_options, tp, cp)


@pytest.mark.parametrize("tp,cp", GRIDS, ids=[f"tp{tp}xcp{cp}" for tp, cp in GRIDS])
def test_unshifted_and_pre_rolled(gloo_pool, tp, cp):
    gloo_pool(tp * cp).run(_check_unshifted_and_pre_rolled, tp, cp)


def _check_uneven_vocab(tp):
    """Returns, per entry point, the error of a vocabulary that leaves a rank empty."""
    for api in ("get_logprobs_from_vocab_parallel_logits", "dtensor_logprobs"):
        _check_dtensor(tp, 1, api, 12, None)
    # V = 9 over 4 ranks: 3, 3, 3, 0. Every rank must raise (before any collective), not
    # only the empty one while the others wait for it in the all-gather.
    mesh, _, _, tp_rank, _ = cp_layout(tp, 1)
    full = torch.randn(CP_BATCH, 6, 9)
    lo, hi = min(9, 3 * tp_rank), min(9, 3 * tp_rank + 3)
    logits = DTensor.from_local(
        full[..., lo:hi], mesh, [Replicate(), Shard(2)], run_check=False, shape=full.shape,
        stride=full.stride(),
    )
    assert dt_api.vocab_shard_bounds(logits) == (lo, hi)
    ids = torch.randint(0, 9, (CP_BATCH, 6))
    messages = {}
    for api, call in (
        ("dtensor_logprobs", lambda: dt_api.dtensor_logprobs(logits, ids)),
        ("get_logprobs", lambda: nemo.get_logprobs_from_vocab_parallel_logits(logits, ids)),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        messages[api] = str(raised.value)
    return messages


def test_dtensor_uneven_vocab(gloo_pool):
    """V = 97 over 4 TP ranks: DTensor gives 25, 25, 25, 22, not 97 // 4 each. V = 9 leaves
    the last rank empty: every rank raises the same error, none hangs in a collective."""
    messages = gloo_pool(4).run(_check_uneven_vocab, 4)
    assert all(rank == messages[0] for rank in messages[1:]), messages
    for message in messages[0].values():
        for part in ("V = 9", "4 ranks of mesh axis 'tp'", "rank 3 with an empty slice",
                     "ceil(9 / 4) = 3", "pad the vocabulary to a multiple of 4 (V = 12)"):
            assert part in message, (part, message)


@settings(max_examples=40, deadline=None)
@given(
    cp_size=st.integers(1, 5),
    chunk=st.integers(1, 3),
    lead=st.integers(1, 2),
    dim=st.sampled_from([0, 1, -1]),
)
def test_get_tokens_on_this_cp_rank(cp_size, chunk, lead, dim):
    x = torch.arange(lead * 2 * cp_size * chunk * 2).view(lead, -1, 2).movedim(1, dim)
    shards = [nemo._get_tokens_on_this_cp_rank(x, r, cp_size, dim) for r in range(cp_size)]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, ref_shard(x, rank, cp_size, dim))


def test_get_tokens_on_this_cp_rank_without_cp():
    """cp_size == 1 returns input_ids whatever the rank, as NeMo-RL (which passes the global
    rank when there is no CP group, or -1 off the group); numpy ints are ints."""
    x = torch.arange(10).view(2, 5)  # odd: no load-balanced chunks without CP
    for rank in (0, 3, -1, np.int64(7)):
        assert nemo._get_tokens_on_this_cp_rank(x, rank, 1) is x
        assert nemo._get_tokens_on_this_cp_rank(x, rank, np.int32(1), 0) is x
    y = torch.arange(24).view(2, 12)
    shard = nemo._get_tokens_on_this_cp_rank(y, np.int64(1), np.int64(3), np.int64(1))
    assert torch.equal(shard, ref_shard(y, 1, 3, 1))


def test_get_tokens_on_this_cp_rank_bad_input():
    x = torch.arange(12)
    # NeMo-RL silently drops the last 12 % 8 tokens; here it is an error.
    with pytest.raises(ValueError, match="12 .* not a multiple of 2 \\* cp_size = 8"):
        nemo._get_tokens_on_this_cp_rank(x, 0, 4, 0)
    for rank in (2, -1):
        pattern = f"cp_rank must be in \\[0, cp_size = 2\\), got {rank}"
        with pytest.raises(ValueError, match=pattern):
            nemo._get_tokens_on_this_cp_rank(x, rank, 2, 0)
    with pytest.raises(ValueError, match="cp_size must be >= 1, got 0"):
        nemo._get_tokens_on_this_cp_rank(x, 0, 0, 0)
    for name, args in (
        ("cp_rank", (1.0, 2)),
        ("cp_size", (0, 2.0)),
        ("cp_rank", (torch.tensor(0), 2)),
        ("cp_size", (0, True)),
        ("cp_rank", (None, 1)),
    ):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            nemo._get_tokens_on_this_cp_rank(x, *args, 0)


def test_without_torch_distributed():
    """No CP group, no TP group (odd sequence lengths allowed): no torch.distributed needed."""
    full = torch.randn(2, 9, 11, dtype=torch.float64).float()
    ids = torch.randint(0, 11, (2, 9))
    expected = oracle_logprobs(full.double()[:, :-1], ids[:, 1:])
    for out in (
        nemo.from_parallel_logits_to_logprobs(full, ids, 0, 11, None),
        nemo.dtensor_from_parallel_logits_to_logprobs(full, ids, 0, 11, None),
        cp_api.context_parallel_logprobs(full, ids),
    ):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    packed_full, packed_ids, cu = _packed_layout((3, 1, 6, 5), 1, 0, torch.int64)
    expected = _packed_oracle(packed_full, packed_ids, cu, 6)
    out = nemo.from_parallel_logits_to_logprobs_packed_sequences(
        packed_full[None].float(), packed_ids[None], cu, 6, 0, VOCAB, None
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # cp_group=None without torch.distributed: no CP, the tensor as it is.
    assert not dist.is_initialized()
    x = torch.randn(2, 5, 3)
    assert nemo.AllGatherCPTensor.apply(x, None) is x
    assert nemo.allgather_cp_sharded_tensor(x, None, seq_dim=1) is x


def test_numpy_ints_are_ints():
    """numpy integer scalars (e.g. from a dataloader) work wherever an int does: the same
    results as Python ints. (Under TP with vocab_start > 0 too: _check_edge_cases.)"""
    full, ids, cu = _packed_layout((3, 1, 6, 5), 1, 0, torch.int64)
    logits = full[None].float()
    for max_seqlen in (1, 6, 9):
        expected = packed_api.packed_context_parallel_logprobs(
            logits, ids[None], cu, max_seqlen=max_seqlen
        )
        for np_int in (np.int64, np.int32, np.uint8):
            out = packed_api.packed_context_parallel_logprobs(
                logits, ids[None], cu, max_seqlen=np_int(max_seqlen), chunk_size=np_int(2)
            )
            assert torch.equal(out, expected), (max_seqlen, np_int)
            out = nemo.from_parallel_logits_to_logprobs_packed_sequences(
                logits, ids[None], cu, np_int(max_seqlen), np_int(0), np_int(VOCAB), None
            )
            assert torch.equal(out, expected), (max_seqlen, np_int)
    logits, ids = logits[:, :12], ids[None, :12]
    expected = cp_api.context_parallel_logprobs(logits, ids)
    for out in (
        cp_api.context_parallel_logprobs(
            logits, ids, vocab_start=np.int64(0), chunk_size=np.int64(5), ignore_index=np.int64(-1)
        ),
        nemo.from_parallel_logits_to_logprobs(
            logits, ids, np.int64(0), np.int64(VOCAB), None, chunk_size=np.int64(5)
        ),
        nemo.dtensor_from_parallel_logits_to_logprobs(
            logits, ids, np.int32(0), np.int32(VOCAB), None
        ),
        nemo.ChunkedDistributedLogprob.apply(
            logits[:, :-1], ids[:, 1:], np.int64(0), np.int64(VOCAB), np.int64(3), None
        ),
    ):
        assert torch.equal(out, expected)


def test_empty_sequence_gives_no_positions():
    """S = 0 gives ``[B, 0]`` however many (padding) positions the logits hold."""
    ids = torch.zeros(2, 0, dtype=torch.long)
    for local_len in (0, 1, 4):
        logits = torch.randn(2, local_len, 11, requires_grad=True)
        outs = (
            cp_api.context_parallel_logprobs(logits, ids),
            *cp_api.context_parallel_logprobs(logits, ids, return_entropy=True, chunk_size=2),
            nemo.from_parallel_logits_to_logprobs(logits, ids, 0, 11, None),
            nemo.dtensor_from_parallel_logits_to_logprobs(logits, ids, 0, 11, None),
        )
        for out in outs:
            assert out.shape == (2, 0), (local_len, out.shape)
        sum(out.sum() for out in outs).backward()
        assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_unscored_ids_may_be_anything():
    """``input_ids[..., 0]`` (and in a packed row each sequence's first token) is never a
    target: any value there, -1 or past the vocabulary, leaves the output as it is."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (2, 9), generator=gen)
    for local_len in (9, 12):  # 12: the padding scores id 0, whatever input_ids hold
        logits = torch.randn(2, local_len, 11, generator=gen)
        expected = cp_api.context_parallel_logprobs(logits, ids, return_entropy=True)
        for bad in (-1, 11, 2**40):
            ids_bad = ids.clone()
            ids_bad[:, 0] = bad
            out = cp_api.context_parallel_logprobs(logits, ids_bad, return_entropy=True)
            assert all(map(torch.equal, out, expected)), (local_len, bad)
            out = nemo.from_parallel_logits_to_logprobs(logits, ids_bad, 0, 11, None)
            assert torch.equal(out, expected[0]), (local_len, bad)

    full, packed_ids, cu = _packed_layout((3, 0, 6, 1), 1, 0, torch.int64)
    firsts = cu[:-1][cu[1:] > cu[:-1]]  # the first token of each non-empty sequence
    expected = _packed_oracle(full, packed_ids, cu, 6)
    for bad in (-1, VOCAB):
        ids_bad = packed_ids.clone()
        ids_bad[firsts] = bad
        for out in (
            packed_api.packed_context_parallel_logprobs(
                full[None].float(), ids_bad[None], cu, max_seqlen=6
            ),
            nemo.from_parallel_logits_to_logprobs_packed_sequences(
                full[None].float(), ids_bad[None], cu, 6, 0, VOCAB, None
            ),
        ):
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_empty_packed_row_gives_zeros():
    """A packed row of no tokens (``cu_seqlens_padded = [0, 0]``): zeros ``[1, max_seqlen - 1]``."""
    ids, cu = torch.zeros(1, 0, dtype=torch.long), torch.tensor([0, 0])
    for cu_dtype, max_seqlen in itertools.product((torch.int32, torch.int64), (1, 2, 6)):
        logits = torch.randn(1, 0, 11, requires_grad=True)
        outs = (
            packed_api.packed_context_parallel_logprobs(
                logits, ids, cu.to(cu_dtype), max_seqlen=max_seqlen
            ),
            *packed_api.packed_context_parallel_logprobs(
                logits, ids, cu.to(cu_dtype), max_seqlen=max_seqlen, return_entropy=True
            ),
            nemo.from_parallel_logits_to_logprobs_packed_sequences(
                logits, ids, cu.to(cu_dtype), max_seqlen, 0, 11, None
            ),
        )
        for out in outs:
            assert torch.equal(out, torch.zeros(1, max_seqlen - 1)), (max_seqlen, out)
        sum(out.sum() for out in outs).backward()
        assert logits.grad.shape == logits.shape


# --- compile contract, host syncs, bad input ---------------------------------------------


def _compile_checks(tp, cp):
    """fullgraph=True forward and backward matches eager, across 4 lengths with at most 2
    compiles per entry point (the second one dynamic)."""
    _, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    torch._dynamo.reset()

    def plain(logits, ids):
        return nemo.from_parallel_logits_to_logprobs(
            logits, ids, lo, hi, tp_group, cp_group=cp_group
        )

    def packed(logits, ids, cu, max_seqlen):
        return nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu, max_seqlen, lo, hi, tp_group, cp_group=cp_group
        )

    def run(fn, leaf, *args):
        leaf = leaf.detach().requires_grad_()
        out = fn(leaf, *args)
        out.backward(torch.ones_like(out))
        return out, leaf.grad

    counts = {}
    for name, fn, cases in (
        ("plain", plain, [(seq,) for seq in (10, 14, 19, 23)]),
        ("packed", packed, [((3, 4, 7), 6), ((9, 1, 4), 9), ((2, 12, 5), 8), ((1, 1, 17), 12)]),
    ):
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        for seed, case in enumerate(cases):
            if name == "plain":
                (seq,) = case
                local_len = 2 * -(-seq // (2 * cp))
                gen = torch.Generator().manual_seed(seed)
                full = torch.randn(CP_BATCH, local_len * cp, VOCAB, generator=gen)
                leaf = ref_shard(full, cp_rank, cp, 1)[..., lo:hi]
                args = (torch.randint(0, VOCAB, (CP_BATCH, seq), generator=gen),)
            else:
                lengths, max_seqlen = case
                full, ids, cu = _packed_layout(lengths, cp, seed, torch.int32)
                bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
                leaf = ref_shard_packed(full, bounds, cp_rank, cp)[None, :, lo:hi].float()
                args = (ids[None], cu, max_seqlen)
            eager_out, eager_grad = run(fn, leaf, *args)
            out, grad = run(compiled, leaf, *args)
            torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
        counts[name] = counter.frame_count
    assert all(count <= 2 for count in counts.values()), counts
    return counts


def _pre_rolled_case(tp, cp, lengths=(3, 5)):
    """``(logits [1, T / C, V_local], this rank's pre-rolled targets [1, T / C], cu)`` of a
    packed row, for the drop-in's ``target_is_pre_rolled``."""
    _, _, _, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    full, ids, cu = _packed_layout(lengths, cp, 0, torch.int32)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    logits = ref_shard_packed(full, bounds, cp_rank, cp)
    rolled = ref_shard_packed(_rolled_within(ids, bounds), bounds, cp_rank, cp)
    return logits[None, :, lo:hi].float(), rolled[None], cu


def _compile_other_entry_points(tp, cp):
    """The DTensor entry points (Inductor), and the CP shard/gather, unshifted targets and
    pre-rolled packed targets (aot_eager, for speed) trace whole, forward and backward, and
    match eager; returns the DTensor entry's compile count."""
    mesh, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    torch._dynamo.reset()
    seq = 8
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(CP_BATCH, seq, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (CP_BATCH, seq), generator=gen)
    seq_index = torch.randperm(seq, generator=gen)
    target = distribute_tensor(ids[:, seq_index], mesh, [Shard(1), Replicate()])

    def from_dtensor(local):
        logits = DTensor.from_local(local, mesh, [Shard(1), Shard(2)], run_check=False)
        return nemo.get_logprobs_from_vocab_parallel_logits(logits, target, seq_index)

    def from_local(local):
        return nemo.dtensor_from_parallel_logits_to_logprobs(
            local, target, lo, hi, tp_group, seq_index=seq_index
        )

    def gather(whole):
        shard = nemo._get_tokens_on_this_cp_rank(whole, cp_rank, cp, 1)
        return nemo.allgather_cp_sharded_tensor(shard, cp_group) * nemo.AllGatherCPTensor.apply(
            cp_api.shard_for_context_parallel(whole, group=cp_group), cp_group, 1
        )

    def unshifted(local):
        return nemo.dtensor_from_parallel_logits_to_logprobs(
            local, target, lo, hi, tp_group, seq_index=seq_index, shift_targets=False
        )

    packed_logits, rolled, cu = _pre_rolled_case(tp, cp)

    def next_token(local):
        # NeMo-RL's dispatcher assumes even vocabulary shards: here there is one (tp = 1).
        return nemo.get_next_token_logprobs_from_logits(
            ids, local, None, tp_rank, tp_group, cp_group
        )

    def pre_rolled(logits):
        return nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, rolled, cu, 6, lo, hi, tp_group, cp_group=cp_group, target_is_pre_rolled=True
        )

    local = full[:, seq_index].chunk(cp, 1)[cp_rank][..., lo:hi]
    counter = CompileCounterWithBackend("inductor")
    for fn, backend, leaf in (
        (from_dtensor, counter, local),
        (from_local, "inductor", local),
        (gather, "aot_eager", full),
        (unshifted, "aot_eager", local),
        (pre_rolled, "aot_eager", packed_logits),
        (next_token, "aot_eager", ref_shard(full, cp_rank, cp, 1)[..., lo:hi]),
    ):
        results = []
        for run in (fn, torch.compile(fn, backend=backend, fullgraph=True)):
            leaf = leaf.detach().requires_grad_()
            out = run(leaf)
            out.backward(torch.ones_like(out))
            results.append((out, leaf.grad))
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    return counter.frame_count


def _host_sync_checks(tp, cp):
    """Eager forward and backward of every entry point, under the host-sync dispatch check."""
    mesh, tp_group, cp_group, tp_rank, _ = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    gen = torch.Generator().manual_seed(0)  # the same ids on every rank
    ids = torch.randint(0, VOCAB, (CP_BATCH, 6 * cp), generator=gen)
    seq_index = torch.randperm(6 * cp, generator=gen)
    logits = torch.randn(CP_BATCH, 6, hi - lo, requires_grad=True)
    full, packed_ids, cu = _packed_layout((3, 5), cp, 0, torch.int32)
    packed_logits = torch.randn(1, full.shape[0] // cp, hi - lo, requires_grad=True)
    dt_logits = distribute_tensor(
        torch.randn(CP_BATCH, 6 * cp, VOCAB), mesh, [Shard(1), Shard(2)]
    ).requires_grad_()
    dt_ids = distribute_tensor(ids, mesh, [Shard(1), Replicate()])
    extras = dict(ignore_index=IGNORE, return_entropy=True)
    ignored_ids = torch.where(ids % 5 == 0, IGNORE, ids)
    pre_rolled_logits, rolled, rolled_cu = _pre_rolled_case(tp, cp)
    pre_rolled_logits.requires_grad_()
    with no_host_syncs():
        outs = [
            nemo.from_parallel_logits_to_logprobs_packed_sequences(
                pre_rolled_logits, rolled, rolled_cu, 5, lo, hi, tp_group, cp_group=cp_group,
                target_is_pre_rolled=True,
            ),
            nemo.gather_logits_at_global_indices(
                logits, torch.stack([ids, ids.flip(-1)], -1)[:, 1:], tp_group, cp_group,
                vocab_start_index=lo, vocab_end_index=hi,
            ),
            *packed_api.packed_context_parallel_logprobs(
                packed_logits, packed_ids[None], cu, max_seqlen=5, vocab_start=lo,
                group=tp_group, cp_group=cp_group, next_token=False, **extras,
            ),
            nemo.from_parallel_logits_to_logprobs(
                logits, ids[:, 1:], lo, hi, tp_group, cp_group=cp_group, chunk_size=4
            ),
            nemo.from_parallel_logits_to_logprobs_packed_sequences(
                packed_logits, packed_ids[None], cu, 5, lo, hi, tp_group, cp_group=cp_group
            ),
            nemo.get_logprobs_from_vocab_parallel_logits(dt_logits, dt_ids, seq_index),
            nemo.allgather_cp_sharded_tensor(logits, cp_group),
            *cp_api.context_parallel_logprobs(
                logits,
                ignored_ids[:, 1:],
                vocab_start=lo,
                group=tp_group,
                cp_group=cp_group,
                temperature=torch.full((CP_BATCH, 6 * cp - 2), 0.7),
                **extras,
            ),
            *packed_api.packed_context_parallel_logprobs(
                packed_logits,
                torch.where(packed_ids % 5 == 0, IGNORE, packed_ids)[None],
                cu,
                max_seqlen=5,
                vocab_start=lo,
                group=tp_group,
                cp_group=cp_group,
                temperature=torch.tensor([[0.5], [2.0]]),
                **extras,
            ),
            *dt_api.dtensor_logprobs(
                dt_logits,
                distribute_tensor(ignored_ids, mesh, [Shard(1), Replicate()]),
                seq_index=seq_index,
                temperature=0.7,
                next_token=False,
                **extras,
            ),
        ]
        sum(out.sum() for out in outs).backward()


class _Collectives(TorchDispatchMode):
    """Records the functional collectives dispatched at the top level (not inside custom ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name not in (
            "wait_tensor",
            "_wrap_tensor_autograd",
        ):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _cp_collectives(tp, cp):
    """The CP collectives of the plain and the packed path: one all-gather forward and one
    reduce-scatter backward each (no all-reduce)."""
    _, tp_group, cp_group, tp_rank, _ = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    logits = torch.randn(CP_BATCH, 6, hi - lo, requires_grad=True)
    ids = torch.randint(0, VOCAB, (CP_BATCH, 6 * cp), generator=torch.Generator().manual_seed(0))
    full, packed_ids, cu = _packed_layout((3, 5, 2), cp, 0, torch.int64)
    packed_logits = torch.randn(1, full.shape[0] // cp, hi - lo, requires_grad=True)
    names = []
    for call in (
        lambda: nemo.from_parallel_logits_to_logprobs(
            logits, ids, lo, hi, tp_group, None, cp_group
        ),
        lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            packed_logits, packed_ids[None], cu, 6, lo, hi, tp_group, cp_group=cp_group
        ),
    ):
        with _Collectives() as forward:
            out = call()
        with _Collectives() as backward:
            out.sum().backward()
        names.append((forward.names, backward.names))
    return names


def test_compile_fullgraph_no_recompiles(gloo_pool):
    counts = gloo_pool(2).run(_compile_checks, 1, 2)
    assert all(count <= 2 for count in counts[0].values()), counts


def test_one_collective_each_way(gloo_pool):
    for forward, backward in itertools.chain(*gloo_pool(2).run(_cp_collectives, 1, 2)):
        assert forward == ["all_gather_into_tensor"], forward
        assert backward == ["reduce_scatter_tensor"], backward


def test_compile_other_entry_points(gloo_pool):
    assert gloo_pool(2).run(_compile_other_entry_points, 1, 2)[0] == 1


def test_no_host_syncs(gloo_pool):
    gloo_pool(4).run(_host_sync_checks, 2, 2)


def _bad_input_messages(tp, cp):
    mesh, tp_group, cp_group, tp_rank, _ = cp_layout(tp, cp)
    lo, hi = vocab_bounds(VOCAB, tp, tp_rank)
    logits = torch.randn(1, 6, hi - lo)
    ids = torch.randint(0, VOCAB, (1, 6 * cp))
    cu = torch.tensor([0, 4 * cp, 6 * cp])
    cases = {
        "odd local length": lambda: nemo.from_parallel_logits_to_logprobs(
            logits[:, :5], ids[:, :5], lo, hi, tp_group, cp_group=cp_group
        ),
        "too short": lambda: nemo.from_parallel_logits_to_logprobs(
            logits, torch.cat([ids, ids], 1), lo, hi, tp_group, cp_group=cp_group
        ),
        "odd gather": lambda: nemo.allgather_cp_sharded_tensor(logits[:, :5], cp_group),
        "cu dtype": lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu.float(), 4, lo, hi, tp_group, cp_group=cp_group
        ),
        "cu rank": lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu[None], 4, lo, hi, tp_group, cp_group=cp_group
        ),
        "cu length": lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu[:1], 4, lo, hi, tp_group, cp_group=cp_group
        ),
        "cu not divisible": lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu + torch.tensor([0, 1, 0]), 4, lo, hi, tp_group, cp_group=cp_group
        ),
        "cu wrong end": lambda: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits, ids, cu[:2], 4, lo, hi, tp_group, cp_group=cp_group
        ),
        "not vocab-sharded": lambda: nemo.get_logprobs_from_vocab_parallel_logits(
            distribute_tensor(torch.randn(1, 6 * cp, VOCAB), mesh, [Shard(1), Shard(1)]), ids
        ),
        "seq_index missing": lambda: nemo.get_logprobs_from_vocab_parallel_logits(
            distribute_tensor(torch.randn(1, 6 * cp, VOCAB), mesh, [Shard(1), Shard(2)]),
            distribute_tensor(ids, mesh, [Shard(1), Replicate()]),
        ),
        "plain tensor logits": lambda: nemo.get_logprobs_from_vocab_parallel_logits(logits, ids),
        # Sequence-sharded logits with a plain (natural-order) target: the CP group and the
        # order come from a DTensor target.
        "plain target under CP": lambda: nemo.get_logprobs_from_vocab_parallel_logits(
            distribute_tensor(torch.randn(1, 6 * cp, VOCAB), mesh, [Shard(1), Shard(2)]),
            ids,
            torch.arange(6 * cp),
        ),
        "plain target under CP, local logits": lambda: (
            nemo.dtensor_from_parallel_logits_to_logprobs(
                logits, ids, lo, hi, tp_group, seq_index=torch.arange(6 * cp)
            )
        ),
        "temperature shape": lambda: cp_api.context_parallel_logprobs(
            logits, ids, vocab_start=lo, group=tp_group, cp_group=cp_group,
            temperature=torch.ones(1, 6 * cp),
        ),
        "packed temperature shape": lambda: packed_api.packed_context_parallel_logprobs(
            logits, ids, cu, max_seqlen=4, vocab_start=lo, group=tp_group, cp_group=cp_group,
            temperature=torch.ones(3, 1),
        ),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        else:
            messages[name] = None
    return messages


def test_bad_input(gloo_pool):
    messages = gloo_pool(4).run(_bad_input_messages, 2, 2)[0]
    expected = {
        "odd local length": "ValueError: .*cannot hold 2 equal load-balanced chunks",
        "too short": "ValueError: .*fewer than the 24 positions",
        "odd gather": "ValueError: .*cannot hold 2 equal",
        "cu dtype": "TypeError: cu_seqlens_padded must be an int32 or int64",
        "cu rank": "ValueError: cu_seqlens_padded must be 1-D",
        "cu length": "ValueError: cu_seqlens_padded must be 1-D",
        "cu not divisible": "RuntimeError: .*multiples of 2 \\* cp_size, on every CP rank",
        "cu wrong end": "RuntimeError: .*end at T",
        "not vocab-sharded": "ValueError: the logits must be sharded on the vocabulary",
        "seq_index missing": "ValueError: seq_index must be given",
        "plain tensor logits": "TypeError: vocab_parallel_logits must be a DTensor",
        "plain target under CP": "ValueError: the logits hold 6 positions, fewer than the 12 "
        "of the target \\(1, 12\\), a plain tensor .*a DTensor sharded on the sequence over "
        "mesh axis 'cp' in seq_index order",
        "plain target under CP, local logits": "ValueError: the logits hold 6 positions, fewer "
        "than the 12 .*a plain tensor \\(which means no CP\\).*DTensor",
        "temperature shape": "ValueError: temperature of shape \\(1, 12\\) does not broadcast "
        "to the output positions \\(1, 11\\)",
        "packed temperature shape": "ValueError: temperature of shape \\(3, 1\\) does not "
        "broadcast to the output positions \\(2, 3\\)",
    }
    for name, pattern in expected.items():
        assert messages[name] is not None, f"{name}: no error"
        assert re.search(pattern, messages[name], flags=re.DOTALL), (name, messages[name])
