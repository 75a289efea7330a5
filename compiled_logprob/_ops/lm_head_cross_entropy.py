"""``compiled_logprob::lm_head_cross_entropy_stats`` and its backward: the distillation
cross-entropy of a teacher's softmax relative to a student's (``_math.cross_entropy``) from
both models' hidden states and LM-head slices, neither's logits materialised.

* ``lm_head_cross_entropy_stats(hidden, weight, teacher_hidden, teacher_weight, temperature,
  *, group_name, chunk_size, sequence_parallel, logits_dtype, teacher_logits_dtype) ->
  CrossEntropyStats``: per tile (a chunk of positions and a block of the vocabulary), both
  models' logits (``_ops.lm_head``) and their ``[B, c, 5]`` statistics, a chunk's blocks
  merged as ranks' are; one all-gather of ``[B, S, 5]`` for the call.
* ``lm_head_cross_entropy_backward``: recomputes both tiles, forms the gradient of
  either model's logits (``_math.cross_entropy.grad_cross_entropy``) and accumulates that
  model's hidden-state and weight gradients; the hidden states' are then all-reduced over the
  TP group (each rank's part covers its vocabulary slice), unless ``sequence_parallel``
  (the all-gather's backward sums them). Only the gradients autograd asks for are formed.

Opaque to the compiler, as the other hidden-state ops. Shape legend: ``B`` batch, ``S``
sequence, ``H``/``H_t`` the student's/teacher's hidden size, ``V_local`` this rank's
vocabulary slice.
"""

from __future__ import annotations

import torch

from compiled_logprob._math import cross_entropy as _ce
from compiled_logprob._math.cross_entropy import CrossEntropyStats
from compiled_logprob._math.kernels import Eager, block_rows
from compiled_logprob._ops.lm_head import HeadGrads, by_chunk, logits_tile, tiles


@torch.library.custom_op("compiled_logprob::lm_head_cross_entropy_stats", mutates_args=())
def lm_head_cross_entropy_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    group_name: str | None,
    chunk_size: int | None,
    sequence_parallel: bool,
    logits_dtype: torch.dtype,
    teacher_logits_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Each weight upcast once for every tile, when its logits are wider.
    weight, teacher_weight = weight.to(logits_dtype), teacher_weight.to(teacher_logits_dtype)
    student, teacher = _tiles(
        hidden, weight, teacher_hidden, teacher_weight, chunk_size, logits_dtype, teacher_logits_dtype
    )
    local = []
    for chunk, teacher_chunk in zip(by_chunk(student), by_chunk(teacher), strict=True):
        rows = chunk[0].rows
        blocks = [
            _ce.cross_entropy_stats(
                logits_tile(hidden[:, rows], weight[tile.cols], tile.logits),
                logits_tile(teacher_hidden[:, rows], teacher_weight[tile.cols], teacher_tile.logits),
                block_rows(temperature, rows),
                ops=Eager(tile.workspace, tile.spare),
            )
            for tile, teacher_tile in zip(chunk, teacher_chunk, strict=True)
        ]
        local.append(_ce.merge_blocks(torch.stack(blocks), block_rows(temperature, rows)))
    result = _ce.exchange_cross_entropy(torch.cat(local, dim=1), group_name, temperature)
    return (*result,)  # the schema's plain tuple, not the NamedTuple


def _tiles(hidden, weight, teacher_hidden, teacher_weight, chunk_size, logits_dtype, teacher_logits_dtype):
    """Both models' tiles, the same chunks and blocks of the vocabulary (``_ops.lm_head``):
    the statistics and the gradients of a block need only its own ids."""
    student = tiles(hidden, weight, chunk_size, spare=True, logits_dtype=logits_dtype, whole_rows=False)
    teacher = tiles(
        teacher_hidden, teacher_weight, chunk_size, spare=False, workspace=False,
        logits_dtype=teacher_logits_dtype, whole_rows=False,
    )
    return student, teacher


@lm_head_cross_entropy_stats.register_fake
def _(hidden, weight, teacher_hidden, teacher_weight, temperature, **options):
    row = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    return tuple(torch.empty_like(row) for _ in CrossEntropyStats._fields)


@torch.library.custom_op("compiled_logprob::lm_head_cross_entropy_backward", mutates_args=())
def lm_head_cross_entropy_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    target_shift: torch.Tensor,
    target_log_norm: torch.Tensor,
    cross_entropy: torch.Tensor,
    *,
    group_name: str | None,
    chunk_size: int | None,
    sequence_parallel: bool,
    logits_dtype: torch.dtype,
    teacher_logits_dtype: torch.dtype,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    saved = CrossEntropyStats(shift, log_norm, target_shift, target_log_norm, cross_entropy)
    sides = [
        HeadGrads(hidden, weight, logits_dtype, needs[0], needs[1]),
        HeadGrads(teacher_hidden, teacher_weight, teacher_logits_dtype, needs[2], needs[3]),
    ]
    weight, teacher_weight = sides[0].weight, sides[1].weight  # in the logits' dtypes
    student, teacher = _tiles(
        hidden, weight, teacher_hidden, teacher_weight, chunk_size, logits_dtype, teacher_logits_dtype
    )
    # Both gradients read both tiles: the student's, rounded, needs a buffer of its own.
    both = sides[0].needed and sides[1].needed and logits_dtype != torch.float32
    rounded = tiles(
        hidden, weight, chunk_size, spare=False, workspace=False, logits_dtype=logits_dtype,
        whole_rows=False,
    ) if both else student
    for tile, teacher_tile, rounded_tile in zip(student, teacher, rounded, strict=True):
        rows, cols = tile.rows, tile.cols
        x = logits_tile(hidden[:, rows], weight[cols], tile.logits)
        y = logits_tile(teacher_hidden[:, rows], teacher_weight[cols], teacher_tile.logits)
        for side, wrt_target, into in ((sides[0], False, rounded_tile.logits), (sides[1], True, y)):
            if not side.needed:
                continue
            gradient = _ce.grad_cross_entropy(
                grad[:, rows],
                x,
                y,
                block_rows(temperature, rows),
                saved.block(rows),
                wrt_target=wrt_target,
                ops=Eager(tile.workspace, tile.spare),
            )
            if gradient.dtype != into.dtype:
                gradient = into.copy_(gradient)  # rounded once, into a spent tile
            side.accumulate(gradient, tile)
    (grad_hidden, grad_weight), (grad_teacher_hidden, grad_teacher_weight) = (
        side.results(group_name, sequence_parallel) for side in sides
    )
    return grad_hidden, grad_weight, grad_teacher_hidden, grad_teacher_weight


@lm_head_cross_entropy_backward.register_fake
def _(grad, hidden, weight, teacher_hidden, teacher_weight, *rest, needs, **options):
    inputs = (hidden, weight, teacher_hidden, teacher_weight)
    return tuple(
        tensor.new_empty(tensor.shape if needed else (0,)) for tensor, needed in zip(inputs, needs)
    )


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    result = CrossEntropyStats(*output)
    # Only the cross-entropy is an output of the public function.
    ctx.mark_non_differentiable(
        result.shift, result.log_norm, result.target_shift, result.target_log_norm
    )
    ctx.save_for_backward(*inputs, *output)
    ctx.options = dict(keyword_only_inputs)


def _backward(ctx, _, __, ___, ____, grad):
    needs = list(ctx.needs_input_grad[:4])
    grads = lm_head_cross_entropy_backward(grad, *ctx.saved_tensors, **ctx.options, needs=needs)
    return *(g if needed else None for g, needed in zip(grads, needs)), None


lm_head_cross_entropy_stats.register_autograd(_backward, setup_context=_setup_context)


def lm_head_cross_entropy_of(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: torch.Tensor | None,
    **options,
) -> CrossEntropyStats:
    """:func:`lm_head_cross_entropy_stats` with its outputs named."""
    return CrossEntropyStats(*lm_head_cross_entropy_stats(
        hidden, weight, teacher_hidden, teacher_weight, temperature, **options
    ))
