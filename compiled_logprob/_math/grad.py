"""Gradients of the per-row statistics with respect to one shard's logits: one elementwise
pass, and no collective.

With ``p = softmax(z)``: ``d log_norm/dz = p``, ``d target_logit_k/dz = onehot(target_k)``,
``d H/dz = −p · (log p + H)``, and ``dz/d logits = 1 / temperature``. For a token log-prob
(``g_log_norm = −g``, ``g_target = g``) that is ``g · (onehot − p)``.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from compiled_logprob._math.kernels import (
    EXPONENT_FLOOR,
    Eager,
    Kernels,
    Traced,
    block_rows,
    exact_exp,
    exponent_scale,
    promoted,
)
from compiled_logprob._math.stats import local_ids


class RowGrads(NamedTuple):
    """The incoming gradients of :class:`~compiled_logprob._math.merge.Stats`' outputs."""

    log_norm: torch.Tensor  # [B, S]
    target_logit: torch.Tensor  # [B, S, K]
    entropy: torch.Tensor | None  # [B, S], None when the entropy was not asked for

    def block(self, rows: slice) -> RowGrads:
        return RowGrads(
            block_rows(self.log_norm, rows),
            block_rows(self.target_logit, rows),
            block_rows(self.entropy, rows),
        )


class RowStats(NamedTuple):
    """What the backward needs of the forward, per row: the saved statistics."""

    shift: torch.Tensor  # [B, S]
    log_norm: torch.Tensor  # [B, S]
    temperature: torch.Tensor | None  # [B, S], None for 1
    entropy: torch.Tensor | None = None  # [B, S], with an entropy gradient
    threshold: torch.Tensor | None = None  # [B, S]: a filtered softmax keeps x >= threshold

    def block(self, rows: slice) -> RowStats:
        return RowStats(
            block_rows(self.shift, rows),
            block_rows(self.log_norm, rows),
            block_rows(self.temperature, rows),
            block_rows(self.entropy, rows),
            block_rows(self.threshold, rows),
        )


def grad_logits(
    grads: RowGrads,
    saved: RowStats,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    ignore_index: int | None,
    *,
    ops: Kernels = Traced(),
) -> torch.Tensor:
    """``d(log_norm, target_logit, entropy)/d logits`` applied to ``grads``, ``[B, S,
    V_local]``, formed in fp32 and rounded once. Rows whose targets are all ignored get
    exactly 0, whatever their logits hold; with a ``threshold``, ``p`` is the filtered
    softmax (0 where ``logits < threshold``).

    Eager (``ops`` an :class:`Eager` on a block): the fp32 block, in ``ops.workspace`` when
    given, with the one-hot terms of ``target`` scatter-added; the caller rounds it.
    Traced: the logits' dtype, as one elementwise pass for the softmax terms and then a
    scatter of the exact values at the K target positions of each row, so that no pass
    over the vocabulary compares against K ids.
    """
    grad = softmax_terms(promoted(logits), grads, saved, ops, into=ops.workspace)
    grad = filtered_out(grad, logits, saved.threshold, ops)
    if target is None:
        return grad if isinstance(ops, Eager) else grad.to(logits.dtype)
    index, grad_target, all_ignored = target_terms(
        grads.target_logit, target, vocab_start, logits.shape[-1], ignore_index, saved.temperature
    )
    if isinstance(ops, Eager):
        return add_target_terms_(grad, index, grad_target, all_ignored)
    # The exact gradient at each scattered position (index 0 stands in for ids this shard
    # does not own, and gets its own exact value): its softmax term plus the one-hot terms
    # of every id that lands there, in id order as a scatter-add adds them (ignored and
    # unowned ones add -0.0, the identity of IEEE addition: a -0.0 gradient keeps its sign
    # whichever shard holds the position).
    at_logits = logits.gather(-1, index)
    at_index = filtered_out(softmax_terms(at_logits.float(), grads, saved, ops), at_logits, saved.threshold, ops)
    for j in range(index.shape[-1]):
        lands = index == index[..., j : j + 1]
        at_index = at_index + torch.where(lands, grad_target[..., j : j + 1], -0.0)
    dense = ops.masked_fill(grad, all_ignored, 0.0).to(logits.dtype)
    exact = ops.masked_fill(at_index, all_ignored, 0.0).to(logits.dtype)
    return dense.scatter(-1, index, exact)


def target_terms(
    grad_target_logit: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab: int,
    ignore_index: int | None,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The one-hot terms of :func:`grad_logits`: ``(index, grad_target, all_ignored)``, the
    ids' local index ``[B, S, K]`` (0 where not owned), the gradient to add there (-0.0 where
    not owned or ignored) and the rows whose targets are all ignored ``[B, S, 1]`` (``None``
    without ``ignore_index`` or without targets, K = 0). Eager kernels form them once for all
    rows."""
    index, owned = local_ids(target, vocab_start, vocab)
    all_ignored = None
    if ignore_index is not None:
        owned = owned & (target != ignore_index)
        if target.shape[-1]:
            all_ignored = (target == ignore_index).all(-1, keepdim=True)
    # -0.0, not 0.0: adding it leaves every value's bits as they are, -0.0 included.
    grad_target = torch.where(owned, grad_target_logit, -0.0)
    if temperature is not None:
        grad_target = grad_target * (1.0 / temperature.unsqueeze(-1))
    return index, grad_target, all_ignored


def add_target_terms_(
    grad: torch.Tensor,
    index: torch.Tensor,
    grad_target: torch.Tensor,
    all_ignored: torch.Tensor | None,
) -> torch.Tensor:
    """Eager, in place on the fp32 block ``grad``: :func:`target_terms`' one-hot terms
    scatter-added, and the rows whose targets are all ignored set to 0."""
    grad.scatter_add_(-1, index, grad_target)
    return grad if all_ignored is None else grad.masked_fill_(all_ignored, 0.0)


def softmax_terms(
    x: torch.Tensor,
    grads: RowGrads,
    saved: RowStats,
    ops: Kernels,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``p · (g_ln − g_H · (H + log p)) / T`` (the ``g_H`` term only with an entropy
    gradient) for logits ``x`` ``[B, S, *]`` of any width: the whole vocabulary, or a few
    gathered entries.

    In exponents ``c = (x − shift) / (unit · T) ≤ 0`` (``shift``: the unscaled row max, so
    that the subtraction is exact where it matters), ``p = e^(unit · c) / total`` and
    ``log p = unit · c − log_norm``: the normaliser folds into per-row factors, so ``p``
    keeps its precision however large the logits are, at no extra pass. The entropy adds a
    multiply-add of ``c`` with per-row constants.
    """
    temperature = saved.temperature
    # Per-row factor of every term: 1 / (total · T).
    factor = exact_exp(-saved.log_norm) * (1.0 if temperature is None else 1.0 / temperature)
    scale = exponent_scale(temperature, ops)
    # per_row gives a tensor for a tensor: the shift is one.
    if grads.entropy is None:
        shift, scale, coefficient = ops.per_row(saved.shift, scale, grads.log_norm * factor)
        exponents = ops.scale(ops.minus(x, cast(torch.Tensor, shift), into), scale)
        return ops.mul(ops.exp(exponents), coefficient)
    assert saved.entropy is not None, "an entropy gradient needs the saved entropy"
    offset = grads.log_norm - grads.entropy * (saved.entropy - saved.log_norm)
    shift, scale, slope, intercept = ops.per_row(
        saved.shift, scale, grads.entropy * (-ops.unit) * factor, offset * factor
    )
    exponents = ops.scale(ops.minus(x, cast(torch.Tensor, shift), into), scale)
    # The floor keeps the weight finite, so that entries of p = 0 (-inf logits, vocabulary
    # padding) get 0 · weight = 0, not NaN.
    exponents = ops.clamp_min(exponents, EXPONENT_FLOOR)
    exps = ops.exp_into(exponents, ops.spare)
    weight = ops.mul(exponents, slope)
    return ops.mul(ops.add(weight, intercept), exps)


def filtered_out(
    grad: torch.Tensor, logits: torch.Tensor, threshold: torch.Tensor | None, ops: Kernels
) -> torch.Tensor:
    """``grad`` with 0 at the ids that the filter drops, ``logits < threshold``."""
    if threshold is None:
        return grad
    return ops.masked_fill(grad, logits < threshold.unsqueeze(-1), 0.0)
