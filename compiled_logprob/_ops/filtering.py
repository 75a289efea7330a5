"""``compiled_logprob::filtered_stats``: the per-row statistics of the top-k/top-p filtered
softmax (``_math.filtering``), over whole rows that one all-to-all of the logits hands each
rank, and one all-gather of per-row statistics (per chunk in eager).

``filtered_stats(logits, target, temperature, *, vocab_start, group_name, ignore_index,
top_k, top_p, chunk_size, inplace_backward) -> FilteredStats``. Its backward is
``compiled_logprob::vocab_parallel_stats_backward`` (or, with ``inplace_backward``, its
in-place twin) with the ``threshold``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob import _comm
from compiled_logprob._math import filtering
from compiled_logprob._math.kernels import block_rows
from compiled_logprob._ops.blocks import MIN_FILTER_ROWS, min_block_elements
from compiled_logprob._ops.stats import logits_grad
from compiled_logprob._torch_compat import register_decomposition


class FilteredStats(NamedTuple):
    """As ``_math.merge.Stats``, over the ids that the filter keeps, ``x >= threshold``."""

    shift: torch.Tensor  # [B, S]
    log_norm: torch.Tensor  # [B, S]
    target_logit: torch.Tensor  # [B, S, K], -inf where filtered out
    threshold: torch.Tensor  # [B, S], unscaled like the shift
    verdict: torch.Tensor  # [B, S] problem bits, as _math.merge.Stats

@torch.library.custom_op("compiled_logprob::filtered_stats", mutates_args=())
def filtered_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    top_k: int,
    top_p: float,
    chunk_size: int | None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Each block of chunk_size positions trades its own whole rows (two collectives per
    # block); the selection then walks them a few rows at a time, its temporaries in cache.
    step = chunk_size or max(logits.shape[1], 1)
    vocab = logits.shape[-1] * _comm.named_size_rank(group_name)[0]
    rows_per_block = max(MIN_FILTER_ROWS, min_block_elements(logits.device) // vocab)
    blocks = [
        filtering.filtered_stats(
            logits[:, start : start + step],
            target[:, start : start + step],
            block_rows(temperature, slice(start, start + step)),
            group_name,
            ignore_index,
            top_k=top_k,
            top_p=top_p,
            rows_per_block=rows_per_block,
        )
        for start in range(0, max(logits.shape[1], 1), step)
    ]
    shift, log_norm, target_logit, threshold, verdict = (
        torch.cat(parts, dim=1) for parts in zip(*blocks)
    )
    return shift, log_norm, target_logit, threshold, verdict


@filtered_stats.register_fake
def _(logits, target, temperature, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    target_logit = torch.empty_like(target, dtype=torch.float32)
    return row, torch.empty_like(row), target_logit, torch.empty_like(row), torch.empty_like(row)


@register_decomposition(torch.ops.compiled_logprob.filtered_stats.default)
def _decompose_filtered(
    logits, target, temperature, *, vocab_start, group_name, ignore_index, top_k, top_p, chunk_size,
    inplace_backward=False,
):
    return filtering.filtered_stats(
        logits, target, temperature, group_name, ignore_index, top_k=top_k, top_p=top_p
    )


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target, temperature = inputs
    result = FilteredStats(*output)
    ctx.mark_non_differentiable(result.shift, result.threshold, result.verdict)
    ctx.save_for_backward(
        logits, target, temperature, result.shift, result.log_norm, result.threshold
    )
    ctx.options = {
        name: keyword_only_inputs[name] for name in ("vocab_start", "ignore_index", "chunk_size")
    }
    ctx.inplace_backward = keyword_only_inputs.get("inplace_backward", False)


def _backward(ctx, _, grad_log_norm, grad_target_logit, __, ___):
    logits, target, temperature, shift, log_norm, threshold = ctx.saved_tensors
    grad = logits_grad(
        ctx,
        grad_log_norm,
        grad_target_logit,
        None,
        logits,
        target,
        temperature,
        shift,
        log_norm,
        None,
        threshold,
    )
    return grad, None, None


filtered_stats.register_autograd(_backward, setup_context=_setup_context)


def filtered_stats_of(
    logits: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor | None, **options
) -> FilteredStats:
    """:func:`filtered_stats` with its outputs named."""
    return FilteredStats(*filtered_stats(logits, target, temperature, **options))
