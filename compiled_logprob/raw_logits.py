"""Raw logits across vocabulary shards, no softmax: the top k, the logits at given ids, and
the whole row gathered.

Shape legend: ``B`` batch, ``S`` sequence, ``K`` ids per position, ``V`` the full
vocabulary, ``V_local`` this rank's slice ``[vocab_start, vocab_start + V_local)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, _comm, _validation
from compiled_logprob._math import merge
from compiled_logprob._math import stats as _local
from compiled_logprob._math import topk as _topk

__all__ = ["gather_vocab_parallel", "vocab_parallel_logits_at", "vocab_parallel_topk_logits"]


@_agreement.agreed
def vocab_parallel_topk_logits(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits over the full (sharded) vocabulary, fp32 ``[..., S, k]`` in
    decreasing order, and their int64 global ids; not differentiable.

    Eager equivalent: ``full_logits.float().topk(k)``.
    One all-gather of ``[..., S, 2k]`` candidates, which block maxima select (as in
    :func:`vocab_parallel_topk`, which gives log-probs with gradients); ``k`` at most every
    rank's ``V_local``.
    """
    _validation.check_logits(logits)
    opts = _validation.options(vocab_start=vocab_start, group=group)
    k = _validation.check_topk(k, opts.vocab_start, logits.shape[-1])
    candidates = _topk.topk_stats(logits.detach(), k, opts.vocab_start)
    size, _ = _comm.size_rank(group)
    return _topk.merge_topk(_comm.gather_ranks(candidates, opts.group_name, size), k)


@_agreement.agreed
def vocab_parallel_logits_at(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The logits at ``K`` global ids per position, fp32 ``[..., S, K]``, from this rank's
    shard ``[..., S, V_local]`` and ``ids`` ``[..., S, K]``.

    Eager equivalent: ``full_logits.float().gather(-1, ids)``.
    Differentiable: each rank's logits receive the upstream gradient at the ids they own
    (the sum over ranks is not differentiated). An id that no rank owns is an error (on
    the device), not a logit of 0. One all-reduce of ``[..., S, 2K]``.
    """
    values, verdict = logits_at_unchecked(logits, ids, vocab_start=vocab_start, group=group)
    merge.assert_verdict(verdict)
    return values


def logits_at_unchecked(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logits_at` and its verdict ``[..., S]`` (ids that no rank owns),
    not yet asserted: for callers that assert it after a context-parallel gather, so that
    every CP rank raises together."""
    _validation.check_logits(logits)
    _validation.check_target(logits, ids, None)
    opts = _validation.options(vocab_start=vocab_start, group=group)
    k = ids.shape[-1]
    # [x at each id where this shard owns it, else 0; 1.0 where it owns it]: summed over TP.
    local = _local.target_stats(logits, ids, opts.vocab_start)
    total = _comm.all_reduce_sum(local.detach(), opts.group_name)
    not_owned = (total[..., k:] != 1).any(-1)
    verdict = merge.verdict_of(not_owned, not_owned=not_owned)
    # The sum's value, with each rank's gradient flowing to its own ids only.
    return (local + (total - local.detach()))[..., :k], verdict


@_agreement.agreed
def gather_vocab_parallel(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every rank's vocabulary shard ``[..., V_local]`` concatenated in rank order,
    ``[..., V]``, on every rank; every rank's shard must be of the same width.

    Eager equivalent: ``torch.cat([shard of rank r for r in range(R)], -1)``.
    Differentiable: each rank's ``tensor`` receives its own slice of its own upstream
    gradient (as Megatron's ``gather_from_tensor_model_parallel_region``), for a loss that
    every rank computes alike. One all-gather forward, no collective backward; the full
    ``[..., V]`` is materialised (prefer the per-row functions above when they suffice).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise TypeError(f"tensor must be a torch.Tensor of shape [..., V_local], got {tensor!r:.80}")
    name = _comm.group_name(group)
    if name is None:
        return tensor
    size, rank = _comm.size_rank(group)
    parts = _comm.gather_ranks(tensor.detach(), name, size).unbind(0)
    return torch.cat([tensor if r == rank else part for r, part in enumerate(parts)], dim=-1)
