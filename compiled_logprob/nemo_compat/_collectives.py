"""NeMo-RL's small collective helpers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_logprob import _comm, context_parallel
from compiled_logprob.nemo_compat._arguments import check_2d, even_tp_shard, group_size
from compiled_logprob.nemo_compat._distillation import (
    distributed_vocab_topk,
    gather_logits_at_global_indices,
)


def group_all_reduce_sum_with_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``group_all_reduce_sum_with_grad``: ``Σ_ranks x``, whose gradient
    is the identity (each rank's own upstream gradient reaches its own ``x``, with no
    collective): for reductions whose every rank computes the same loss. ``x`` as it is for
    ``None``, a group of size 1 or without torch.distributed."""
    if group is None or group_size(group) == 1:
        return x
    total = _comm.all_reduce_sum(x.detach(), group.group_name)
    return x + (total - x.detach())


def group_all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``group_all_reduce_sum``: ``Σ_ranks x`` as a constant (no
    gradient), for normalisers such as global token counts."""
    return group_all_reduce_sum_with_grad(x.detach(), group)


def vocab_parallel_argmax(
    logits: torch.Tensor, *, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_argmax``: the global id of each position's largest
    logit, int64 ``[B, S]``, of this rank's even shard ``[B, S, V_local]`` (rank r holds
    ``[r · V_local, (r + 1) · V_local)``) or of a DTensor's local shard; not differentiable.
    One all-gather of ``[B, S, 2]`` (:func:`distributed_vocab_topk` with k = 1)."""
    logits, group, start = even_tp_shard(logits, tp_group)
    _, ids = distributed_vocab_topk(
        logits, 1, group, vocab_start_index=start, vocab_end_index=start + logits.shape[-1]
    )
    return ids.squeeze(-1)


def vocab_parallel_gather_columns(
    logits: torch.Tensor,
    column_indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_gather_columns``: the raw logits at one shared set
    of K global vocabulary ids ``column_indices`` ``[K]``, fp32 ``[B, T, K]``, from this
    rank's even shard ``[B, T, V_local]`` (or the full ``[B, T, V]`` without a group);
    differentiable, each rank's logits receiving the gradient at the ids they own. One
    all-reduce (:func:`gather_logits_at_global_indices`)."""
    if column_indices.dim() != 1:
        raise ValueError(
            f"column_indices must be [K] global ids, got shape {tuple(column_indices.shape)}"
        )
    logits, group, start = even_tp_shard(logits, tp_group)
    ids = column_indices.to(logits.device).expand(*logits.shape[:-1], -1)
    return gather_logits_at_global_indices(
        logits, ids, group, vocab_start_index=start, vocab_end_index=start + logits.shape[-1]
    )


def all_to_all_vp2sq(
    vocab_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``all_to_all_vp2sq``: ``[BS, V_local]`` (every row, this rank's
    vocabulary slice) to ``[BS / TP, V]`` (this rank's rows, every slice; rank r gets rows
    ``[r · BS / TP, (r + 1) · BS / TP)``). One all-to-all; not differentiable."""
    size = group_size(tp_group)
    rows, width = check_2d(vocab_parallel_logits, "vocab_parallel_logits", size, dim=0)
    if size == 1:
        return vocab_parallel_logits
    received = _comm.all_to_all(vocab_parallel_logits, tp_group.group_name)
    # [TP · BS / TP, V_local] by source rank -> [BS / TP, TP · V_local]
    return received.view(size, rows // size, width).permute(1, 0, 2).reshape(rows // size, -1)


def all_to_all_sq2vp(
    seq_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``all_to_all_sq2vp``, the inverse of :func:`all_to_all_vp2sq`:
    ``[BS / TP, V]`` to ``[BS, V_local]``. One all-to-all; not differentiable."""
    size = group_size(tp_group)
    rows, vocab = check_2d(seq_parallel_logits, "seq_parallel_logits", size, dim=1)
    if size == 1:
        return seq_parallel_logits
    by_rank = seq_parallel_logits.view(rows, size, vocab // size).permute(1, 0, 2).contiguous()
    received = _comm.all_to_all(by_rank.view(-1, vocab // size), tp_group.group_name)
    return received.view(size * rows, vocab // size)


def cp_load_balanced_to_contiguous(
    x: torch.Tensor, *, cp_group: dist.ProcessGroup | None = None, seq_dim: int = 1
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``cp_load_balanced_to_contiguous``: this CP rank's contiguous
    window ``[r · L, (r + 1) · L)`` of the sequence, from its load-balanced shard of ``L``
    positions; differentiable (through :func:`compiled_logprob.gather_context_parallel`)."""
    if isinstance(x, DTensor):
        x = x.to_local()
    size = group_size(cp_group)
    if cp_group is None or size == 1:
        return x
    full = context_parallel.gather_context_parallel(x, group=cp_group, dim=seq_dim)
    length = x.shape[seq_dim]
    return full.narrow(seq_dim, cp_group.rank() * length, length).contiguous()


def cp_shift_next(
    x: torch.Tensor, cp_group: dist.ProcessGroup | None = None, *, fill: float
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``cp_shift_next``: ``out[:, t] = x[:, t + 1]`` over the global
    sequence of contiguous CP shards ``[B, L, ...]`` (dim 1), the last global position
    ``fill``. The next rank's first position arrives by one all-gather and carries no
    gradient back; the rest is differentiable."""
    size = group_size(cp_group)
    following = torch.full_like(x[:, :1], fill)
    if cp_group is not None and size > 1:
        firsts = _comm.gather_ranks(x[:, :1].detach(), cp_group.group_name, size)
        rank = cp_group.rank()
        if rank + 1 < size:
            following = firsts[rank + 1]
    return torch.cat([x[:, 1:], following], dim=1)
