"""References shared by the tests and the benchmarks.

* The **oracle**: float64, full-vocabulary, single-process eager math. Everything in the
  package is checked against it.
* The **seed algorithm**: the eager vocab-parallel log-prob that this package replaces
  (NeMo-RL's ``DistributedLogprob``/``ChunkedDistributedLogprob``): cast the shard to fp32,
  all-reduce the max, subtract, all-reduce the sum of exps, take the log-softmax, gather the
  targets (masked to 0 off-shard), all-reduce, and save the fp32 softmax for backward. It is
  the baseline the benchmarks measure against, in its own words here so that ``perf/``
  needs nothing outside this package. ``SeedDistributedCrossEntropy`` is its distillation
  counterpart (NeMo-RL's ``DistributedCrossEntropy``).

Shape legend: ``B`` batch, ``S`` sequence, ``V`` full vocabulary, ``V_local`` one shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "SeedChunkedDistributedLogprob",
    "SeedDistributedCrossEntropy",
    "SeedDistributedLogprob",
    "SeedLogprobWithSampling",
    "oracle_cross_entropy",
    "oracle_entropy",
    "oracle_filtered_log_softmax",
    "oracle_log_softmax",
    "oracle_logprobs",
    "oracle_logsumexp",
    "oracle_topk",
    "vocab_bounds",
]


def _scaled(full_logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """float64 ``full_logits / temperature``; a tensor ``temperature`` broadcasts to ``[...]``."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double().unsqueeze(-1)
    return full_logits.double() / temperature


def oracle_log_softmax(
    full_logits: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """float64 ``[..., V]`` log-softmax of the unsharded logits over ``temperature``."""
    return torch.log_softmax(_scaled(full_logits, temperature), dim=-1)


def oracle_logsumexp(
    full_logits: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """float64 ``[...]`` logsumexp of the unsharded logits over ``temperature``."""
    return torch.logsumexp(_scaled(full_logits, temperature), dim=-1)


def oracle_logprobs(
    full_logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """float64 log-probs of ``target`` under the full-vocabulary softmax of the logits over
    ``temperature``: ``target`` ``[...]`` gives ``[...]``, ``target`` ``[..., K]`` (``K`` ids
    per position) gives ``[..., K]``.

    Positions whose target equals ``ignore_index`` hold 0 (and get no gradient).
    """
    per_position = target.dim() == full_logits.dim() - 1
    ids = target.unsqueeze(-1) if per_position else target
    ignored = torch.zeros_like(ids, dtype=torch.bool)
    if ignore_index is not None:
        ignored = ids == ignore_index
    log_softmax = oracle_log_softmax(full_logits, temperature)
    logprobs = torch.where(ignored, 0.0, log_softmax.gather(-1, torch.where(ignored, 0, ids)))
    return logprobs.squeeze(-1) if per_position else logprobs


def oracle_entropy(
    full_logits: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """float64 ``[...]`` entropy ``-Σ p log p`` of the full-vocabulary softmax over
    ``temperature``; a ``-inf`` logit (``p = 0``) contributes 0, and no NaN to the gradient."""
    log_softmax = oracle_log_softmax(full_logits, temperature)
    probs = log_softmax.exp()
    return -(probs * torch.where(probs > 0, log_softmax, 0.0)).sum(-1)


def oracle_cross_entropy(
    full_logits: torch.Tensor, full_target_logits: torch.Tensor, temperature=1.0
) -> torch.Tensor:
    """``−Σ softmax(y / T) · log_softmax(x / T)`` in float64, ``[..., S]``; a target id of
    probability 0 adds 0 (also at a ``-inf`` logit, where the masked ``log q`` keeps the
    gradient finite)."""
    p = torch.softmax(_scaled(full_target_logits, temperature), -1)
    log_q = torch.where(p == 0, 0.0, torch.log_softmax(_scaled(full_logits, temperature), -1))
    return -(p * log_q).sum(-1)


def oracle_topk(
    full_logits: torch.Tensor, k: int, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[..., k]`` top-``k`` log-probs over the full vocabulary and their int64 ids,
    in decreasing order."""
    return oracle_log_softmax(full_logits, temperature).topk(k, dim=-1)


def oracle_filtered_log_softmax(
    full_logits: torch.Tensor,
    top_k: int | None = None,
    top_p: float = 1.0,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[..., V]`` log-softmax over the ids that top-k then top-p filtering keeps
    (``-inf`` elsewhere; gradient only through the kept ids), and top-p's margin ``[...]``.

    Top-k keeps the ids of at least the k-th largest logit; top-p keeps, of those, each id
    whose strictly more probable ids hold less than ``top_p`` of their mass. The margin is
    the smallest ``|mass above − top_p|`` over the kept ids' values: a row whose margin is
    within rounding of 0 may be filtered either way (``inf`` without top-p).
    """
    z = _scaled(full_logits, temperature)
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:
        keep = z >= z.detach().topk(min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
    margin = torch.full(z.shape[:-1], float("inf"), dtype=torch.float64)
    if top_p < 1:
        with torch.no_grad():
            probs = torch.softmax(torch.where(keep, z, -torch.inf), dim=-1)
            ascending, order = torch.where(keep, z, -torch.inf).sort(-1)
            mass = probs.gather(-1, order).cumsum(-1)
            # Mass of the ids at most each id's value, hence strictly above it.
            at_most = mass.gather(-1, torch.searchsorted(ascending, z, right=True) - 1)
            above = (mass[..., -1:] - at_most).clamp(min=0)
            keep = keep & (above < top_p)
            margin = torch.where(probs > 0, (above - top_p).abs(), torch.inf).amin(-1)
    kept = torch.where(keep, z, -torch.inf)
    return torch.where(keep, z - torch.logsumexp(kept, -1, keepdim=True), -torch.inf), margin


def vocab_bounds(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s shard when ``vocab_size`` is split as evenly as possible:
    the first ``vocab_size % world_size`` ranks hold one extra id."""
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> torch.Tensor:
    if group is not None and group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _seed_log_softmax(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    logits_max = torch.amax(logits, dim=-1, keepdim=True)
    _all_reduce(logits_max, dist.ReduceOp.MAX, group)
    shifted = logits - logits_max
    sum_exp = shifted.exp().sum(-1, keepdim=True)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    return shifted - sum_exp.log()


def _seed_masked_targets(target: torch.Tensor, start: int, end: int):
    off_shard = (target < start) | (target >= end)
    local = target - start
    local[off_shard] = 0
    return off_shard, local


class SeedDistributedLogprob(torch.autograd.Function):
    """The seed algorithm, unchunked: saves the full fp32 softmax for backward."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end, group, inference_only=False):
        off_shard, local = _seed_masked_targets(target, vocab_start, vocab_end)
        log_probs = _seed_log_softmax(logits.float(), group)
        softmax = log_probs.exp()
        picked = log_probs.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked[off_shard] = 0.0
        _all_reduce(picked, dist.ReduceOp.SUM, group)
        if not inference_only:
            ctx.save_for_backward(softmax, off_shard, local)
        return picked

    @staticmethod
    def backward(ctx, grad_output):
        softmax, off_shard, local = ctx.saved_tensors
        chosen = (~off_shard).unsqueeze(-1) * torch.nn.functional.one_hot(
            local, num_classes=softmax.shape[-1]
        )
        grad = chosen.float().sub_(softmax).mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None, None, None


class SeedChunkedDistributedLogprob(torch.autograd.Function):
    """The seed algorithm, chunked over the sequence: saves the logits, recomputes per chunk."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end, chunk_size, group, inference_only=False):
        off_shard, local = _seed_masked_targets(target, vocab_start, vocab_end)
        pieces = []
        for s in range(0, logits.shape[1], chunk_size):
            log_probs = _seed_log_softmax(logits[:, s : s + chunk_size].float(), group)
            picked = log_probs.gather(-1, local[:, s : s + chunk_size].unsqueeze(-1)).squeeze(-1)
            picked[off_shard[:, s : s + chunk_size]] = 0.0
            _all_reduce(picked, dist.ReduceOp.SUM, group)
            pieces.append(picked)
        if not inference_only:
            ctx.save_for_backward(logits, off_shard, local)
            ctx.chunk_size, ctx.group = chunk_size, group
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        logits, off_shard, local = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for s in range(0, logits.shape[1], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            softmax = _seed_log_softmax(logits[:, rows].float(), ctx.group).exp()
            chosen = (~off_shard[:, rows]).unsqueeze(-1) * torch.nn.functional.one_hot(
                local[:, rows], num_classes=logits.shape[-1]
            )
            grad[:, rows] = chosen.float().sub_(softmax).mul_(grad_output[:, rows].unsqueeze(-1))
        return grad, None, None, None, None, None, None


class SeedDistributedCrossEntropy(torch.autograd.Function):
    """The seed algorithm's soft-target cross-entropy ``−Σ p log q``: fp32 copies of both
    shards, the teacher's softmax and the student's log-softmax over the full vocabulary
    (two all-reduces each), a per-row dot product, an all-reduce; saves ``p`` and ``q``, two
    fp32 ``[B, S, V_local]`` buffers, for the backward ``g · (q − p)``."""

    @staticmethod
    def forward(ctx, logits, target_logits, group, inference_only=False):
        p = _seed_log_softmax(target_logits.float(), group).exp_()
        log_q = _seed_log_softmax(logits.float(), group)
        cross_entropy = torch.einsum("...v,...v->...", p, log_q).neg_()
        _all_reduce(cross_entropy, dist.ReduceOp.SUM, group)
        if not inference_only:
            ctx.save_for_backward(p, log_q.exp_())
        return cross_entropy

    @staticmethod
    def backward(ctx, grad_output):
        p, q = ctx.saved_tensors
        return (q - p) * grad_output.unsqueeze(-1), None, None, None


class SeedLogprobWithSampling(torch.autograd.Function):
    """The seed algorithm of filtered log-probs (NeMo-RL's ``DistributedLogprobWithSampling``)
    on an unsharded vocabulary, where its all-to-all is the identity: vLLM's sort-based top-k
    and top-p filter (``-inf`` at the dropped ids; top-p's softmax and cumsum in the logits'
    dtype; among tied ids the sort decides), the fp32 log-softmax of the filtered logits, a
    gather; saves the fp32 softmax and the keep mask for backward."""

    @staticmethod
    def forward(ctx, logits, target, top_k, top_p, inference_only=False):
        keep = torch.ones_like(logits, dtype=torch.bool)
        if top_p < 1:
            ordered, order = logits.sort(-1)
            if top_k is not None:
                ordered = ordered.masked_fill(ordered < ordered[..., -top_k:][..., :1], -torch.inf)
            kept = ordered.softmax(-1).cumsum(-1) > 1 - top_p
            kept[..., -1] = True
            kept &= ordered > -torch.inf
            keep = kept.scatter(-1, order, kept)
        elif top_k is not None:
            keep = logits >= logits.topk(top_k, dim=-1).values[..., -1:]
        log_probs = torch.log_softmax(logits.masked_fill(~keep, -torch.inf).float(), dim=-1)
        picked = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if not inference_only:
            ctx.save_for_backward(log_probs.exp(), target, keep)
        return picked

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target, keep = ctx.saved_tensors
        chosen = torch.nn.functional.one_hot(target, num_classes=softmax.shape[-1])
        grad = chosen.float().sub_(softmax).mul_(grad_output.unsqueeze(-1)).mul_(keep)
        return grad, None, None, None, None
