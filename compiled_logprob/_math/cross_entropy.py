"""The distillation cross-entropy ``H(p, q) = −Σ p log q`` over the sharded vocabulary, with
``p = softmax(y / T)`` of the target logits and ``q = softmax(x / T)`` of the logits: one
pass over both per shard, one all-gather of ``[B, S, 5]``, and a backward with no
collective."""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob import _comm
from compiled_logprob._math.kernels import (
    PAIR_SLICES,
    Eager,
    Kernels,
    Traced,
    block_rows,
    exponent_scale,
    finite_or_zero,
    promoted,
)


class CrossEntropyStats(NamedTuple):
    """Per-row results of :func:`exchange_cross_entropy`, fp32 ``[B, S]`` each."""

    shift: torch.Tensor  # the logits' row max (0 where infinite)
    log_norm: torch.Tensor  # log Σ exp(x / T − shift / T)
    target_shift: torch.Tensor  # the same two of the target logits
    target_log_norm: torch.Tensor
    cross_entropy: torch.Tensor  # H(p, q)

    def block(self, rows: slice) -> CrossEntropyStats:
        return CrossEntropyStats(*(block_rows(t, rows) for t in self))


def common_shift(
    row_max: torch.Tensor, sum_exp: torch.Tensor, inverse_t: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, shard_mass, factor)`` of every rank's row max and ``Σ exp(z − its max)``
    ``[R, B, S]``: the common ``shift`` (the global max, 0 where infinite), each shard's sum
    rescaled to it, and the rescaling ``factor``. A -inf shard's factor is exp(-inf) = 0,
    whatever the shift it summed with."""
    shift = finite_or_zero(row_max.amax(0))
    factor = torch.exp((row_max - shift) * inverse_t)
    return shift, sum_exp * factor, factor


def cross_entropy_stats(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    ops: Kernels = Traced(),
) -> torch.Tensor:
    """This shard's statistics for :func:`exchange_cross_entropy`, fp32 ``[B, S, 5]``:
    ``[max x, Σ exp(u), max y, Σ exp(v), Σ exp(v) · (−u)]`` of the logits ``x`` and the
    target logits ``y`` (``[B, S, V_local]`` each), with ``u = (x − max x) / T`` and
    ``v = (y − max y) / T`` (each max taken as 0 where it is infinite), exponentiated in
    ``ops``' units.

    The last sum's terms are non-negative and 0 wherever ``exp(v)`` is 0: vocabulary padding
    (``-inf`` in both) adds 0, while target mass on a ``-inf`` logit makes the sum, and the
    cross-entropy, ``inf``. Traced, one pass over both inputs; eager, in place in
    ``ops.workspace`` and ``ops.spare`` when given.
    """
    workspace, spare = ops.workspace, ops.spare
    x, y = ops.fp32(logits, workspace), promoted(target_logits)
    if x is not logits and x.dtype != logits.dtype:
        workspace = x  # a fresh fp32 copy: shift it in place
    # Eager, the target is converted only for its max: spare holds exp(u) before its turn.
    x_max, y_max = (ops.row_max(t).float() for t in (x, ops.fp32(y, spare)))
    (scale,) = ops.per_row(exponent_scale(temperature, ops))
    centred = ops.scale(ops.minus(x, finite_or_zero(x_max), workspace), scale)
    # spare holds exp(u) until its sum is taken, then the target's exponentials.
    total = ops.row_sum(ops.exp_into(centred, spare), PAIR_SLICES)
    target_exps = ops.exp(ops.scale(ops.minus(y, finite_or_zero(y_max), spare), scale))
    if isinstance(ops, Eager):
        # −u · exp(v) is NaN only where exp(v) = 0 and u = -inf: a term that is 0 (a NaN
        # logit still gives NaN, through the maxima).
        gaps = -centred.mul_(target_exps).nansum(-1, keepdim=True)
    else:
        gaps = ops.row_sum(torch.where(target_exps == 0, 0.0, target_exps * -centred), PAIR_SLICES)
    target_total = ops.row_sum(target_exps, PAIR_SLICES)
    return torch.cat([x_max, total, y_max, target_total, gaps * ops.unit], dim=-1)


class _Merged(NamedTuple):
    """Parts' statistics ``[P, B, S, 5]`` rescaled to common shifts and summed, ``[B, S]``."""

    shift: torch.Tensor  # the largest logit (0 where infinite)
    mass: torch.Tensor  # Σ exp((x − shift) / T)
    target_shift: torch.Tensor
    target_mass: torch.Tensor  # Σ exp((y − target_shift) / T)
    gaps: torch.Tensor  # Σ exp((y − target_shift) / T) · (shift − x) / T


def _merge(parts: torch.Tensor, inverse_t: float | torch.Tensor) -> _Merged:
    """Merges the :func:`cross_entropy_stats` of parts of a vocabulary (ranks' shards, or a
    shard's blocks): each part's sum of gaps to its own max gains its target mass times the
    distance between its max and the common one."""
    shift, mass, _ = common_shift(parts[..., 0], parts[..., 1], inverse_t)
    target_shift, target_mass, target_factor = common_shift(parts[..., 2], parts[..., 3], inverse_t)
    climb = (shift - finite_or_zero(parts[..., 0])) * inverse_t
    gaps = parts[..., 4] * target_factor + torch.where(target_mass == 0, 0.0, target_mass * climb)
    return _Merged(shift, mass.sum(0), target_shift, target_mass.sum(0), gaps.sum(0))


def _inverse(temperature: torch.Tensor | None) -> float | torch.Tensor:
    return 1.0 if temperature is None else 1.0 / temperature


def merge_blocks(blocks: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """A shard's :func:`cross_entropy_stats` ``[B, S, 5]`` from those of its blocks of ids
    ``[P, B, S, 5]``, merged as :func:`exchange_cross_entropy` merges ranks' (every rank
    then gathers one ``[B, S, 5]``, whatever its number of blocks)."""
    merged = _merge(blocks, _inverse(temperature))
    maxima = blocks[..., 0].amax(0), blocks[..., 2].amax(0)  # as a shard reports them
    return torch.stack(
        [maxima[0], merged.mass, maxima[1], merged.target_mass, merged.gaps], dim=-1
    )


def exchange_cross_entropy(
    stats: torch.Tensor, group_name: str | None, temperature: torch.Tensor | None
) -> CrossEntropyStats:
    """All-gather :func:`cross_entropy_stats` (the one collective) and merge every rank's.

    ``H(p, q) = log_norm + Σ p · (shift − x) / T``: both terms are non-negative (each shard's
    part of the second is its own sum of gaps to its own max, rescaled to the common shifts,
    plus its target mass times the distance between its max and the global one), so nothing
    cancels however large the logits are.
    """
    merged = _merge(_comm.gather_ranks(stats, group_name), _inverse(temperature))
    log_norm = torch.log(merged.mass)
    cross_entropy = log_norm + merged.gaps / merged.target_mass
    return CrossEntropyStats(
        merged.shift, log_norm, merged.target_shift, torch.log(merged.target_mass), cross_entropy
    )


def grad_cross_entropy(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    saved: CrossEntropyStats,
    *,
    wrt_target: bool,
    ops: Kernels = Traced(),
) -> torch.Tensor:
    """``g · dH(p, q)``, fp32 ``[B, S, V_local]``, with respect to the logits,
    ``g · (q − p) / T``, or (``wrt_target``) the target logits,
    ``g · p · (−log q − H) / T``; no collective. ``p`` is 0 where ``y`` is ``-inf``, and so
    is the target gradient there, even where ``−log q`` is ``inf``. Eager, in place in the
    fp32 blocks ``ops.workspace`` (which the result is) and ``ops.spare`` when given.

    Each exponential is scaled by its own per-row factor, ``g`` included, rather than ``g``
    scaling ``q − p``: traced, a ``[B, S, V_local]`` term free of ``g`` would let the
    partitioner compute it in the forward and save it.
    """
    inverse_t: float | torch.Tensor = 1.0 if temperature is None else 1.0 / temperature
    row_scale = grad * inverse_t

    def exps(z, rows_shift, log_norm, factor, into):  # e^((z − shift) / T − log_norm) · factor
        scale, coefficient = ops.per_row(
            exponent_scale(temperature, ops), factor * torch.exp(-log_norm)
        )
        exponents = ops.scale(ops.minus(promoted(z), rows_shift.unsqueeze(-1), into), scale)
        return ops.mul(ops.exp(exponents), coefficient)

    def p_terms():
        return exps(target_logits, saved.target_shift, saved.target_log_norm, row_scale, ops.spare)

    if not wrt_target:
        q_terms = exps(logits, saved.shift, saved.log_norm, row_scale, ops.workspace)
        return ops.sub(q_terms, p_terms())
    # g · p · (−log q − H) / T = g · p / T · (log_norm − H − u), u = (x − shift) / T in nats.
    inverse_rows, offset = ops.per_row(inverse_t, saved.log_norm - saved.cross_entropy)
    surprise = ops.minus(promoted(logits), saved.shift.unsqueeze(-1), ops.workspace)
    surprise = ops.add(ops.neg(ops.scale(surprise, inverse_rows)), offset)
    p = p_terms()
    return ops.masked_fill(ops.mul(surprise, p), p == 0, 0.0)
