"""``compiled_logprob::lm_head_filtered_stats``: token log-probs under a sampler's top-k/top-p
filtered softmax straight from hidden states, the logits never materialised.

``lm_head_filtered_stats(hidden, weight, target, temperature, *, vocab_start, group_name,
ignore_index, chunk_size, top_k, top_p, sequence_parallel, logits_dtype) -> FilteredStats``:
per sequence chunk, the logits tile of ``_ops.lm_head``, filtered as the logits path filters
(``_math.filtering``: one all-to-all of the tile hands each rank whole rows, one all-gather
of per-row statistics brings them back). Its backward is ``lm_head_stats_backward`` with the
``threshold``: each tile recomputed, no collective but the hidden states' gradient's.
Opaque to the compiler, as the other hidden-state ops.

Shape legend: ``B`` batch, ``S`` sequence, ``H`` hidden size, ``V_local`` this rank's
vocabulary slice, ``K`` target ids per position.
"""

from __future__ import annotations

import torch

from compiled_logprob import _comm
from compiled_logprob._math import filtering
from compiled_logprob._math import grad as _grad
from compiled_logprob._math.kernels import block_rows
from compiled_logprob._ops.blocks import MIN_FILTER_ROWS, min_block_elements
from compiled_logprob._ops.filtering import FilteredStats
from compiled_logprob._ops.lm_head import backward_options, input_grads, logits_tile, tiles


@torch.library.custom_op("compiled_logprob::lm_head_filtered_stats", mutates_args=())
def lm_head_filtered_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    chunk_size: int | None,
    top_k: int,
    top_p: float,
    sequence_parallel: bool,
    logits_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = weight.to(logits_dtype)  # upcast once for every tile, when the logits are wider
    vocab = weight.shape[0] * _comm.named_size_rank(group_name)[0]
    rows_per_block = max(MIN_FILTER_ROWS, min_block_elements(hidden.device) // vocab)
    blocks = [
        filtering.filtered_stats(
            logits_tile(hidden[:, tile.rows], weight, tile.logits),
            target[:, tile.rows],
            block_rows(temperature, tile.rows),
            group_name,
            ignore_index,
            top_k=top_k,
            top_p=top_p,
            rows_per_block=rows_per_block,
        )
        for tile in tiles(
            hidden, weight, chunk_size, spare=False, workspace=False, logits_dtype=logits_dtype
        )
    ]
    shift, log_norm, target_logit, threshold, verdict = (
        torch.cat(parts, dim=1) for parts in zip(*blocks)
    )
    return shift, log_norm, target_logit, threshold, verdict


@lm_head_filtered_stats.register_fake
def _(hidden, weight, target, temperature, **options):
    row = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    target_logit = torch.empty_like(target, dtype=torch.float32)
    return row, torch.empty_like(row), target_logit, torch.empty_like(row), torch.empty_like(row)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, target, temperature = inputs
    result = FilteredStats(*output)
    ctx.mark_non_differentiable(result.shift, result.threshold, result.verdict)
    ctx.save_for_backward(
        hidden, weight, target, temperature, result.shift, result.log_norm, result.threshold
    )
    ctx.options = backward_options(keyword_only_inputs)


def _backward(ctx, _, grad_log_norm, grad_target_logit, __, ___):
    hidden, weight, target, temperature, shift, log_norm, threshold = ctx.saved_tensors
    grads = _grad.RowGrads(grad_log_norm, grad_target_logit, None)
    saved = _grad.RowStats(shift, log_norm, temperature, threshold=threshold)
    return input_grads(ctx, grads, saved, hidden, weight, target)


lm_head_filtered_stats.register_autograd(_backward, setup_context=_setup_context)


def lm_head_filtered_stats_of(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    **options,
) -> FilteredStats:
    """:func:`lm_head_filtered_stats` with its outputs named."""
    return FilteredStats(*lm_head_filtered_stats(hidden, weight, target, temperature, **options))
