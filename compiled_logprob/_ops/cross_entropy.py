"""``compiled_logprob::cross_entropy_stats`` and its backward: the distillation
cross-entropy ``H(p, q)`` ``[B, S]`` of ``p = softmax(target_logits / T)`` relative to
``q = softmax(logits / T)`` over the sharded vocabulary (``_math.cross_entropy``).

* ``cross_entropy_stats(logits, target_logits, temperature, *, group_name, chunk_size) ->
  CrossEntropyStats``: one all-gather of ``[B, S, 5]``; only ``cross_entropy`` is
  differentiable, the rest are the per-row statistics that backward needs.
* ``cross_entropy_backward``: either input's gradient, one elementwise pass, no collective.
"""

from __future__ import annotations

import torch

from compiled_logprob._math import cross_entropy as _ce
from compiled_logprob._math.cross_entropy import CrossEntropyStats
from compiled_logprob._math.kernels import Eager, block_rows
from compiled_logprob._ops.blocks import seq_blocks
from compiled_logprob._torch_compat import register_decomposition


@torch.library.custom_op("compiled_logprob::cross_entropy_stats", mutates_args=())
def cross_entropy_stats(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    group_name: str | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    local = torch.cat(
        [
            _ce.cross_entropy_stats(
                logits[:, block.rows],
                target_logits[:, block.rows],
                block_rows(temperature, block.rows),
                ops=Eager(block.workspace, block.spare),
            )
            for block in seq_blocks(logits, chunk_size, spare=True)
        ],
        dim=1,
    )
    result = _ce.exchange_cross_entropy(local, group_name, temperature)
    return (*result,)  # the schema's plain tuple, not the NamedTuple


@cross_entropy_stats.register_fake
def _(logits, target_logits, temperature, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return tuple(torch.empty_like(row) for _ in CrossEntropyStats._fields)


@register_decomposition(torch.ops.compiled_logprob.cross_entropy_stats.default)
def _decompose_cross_entropy(logits, target_logits, temperature, *, group_name, chunk_size):
    local = _ce.cross_entropy_stats(logits, target_logits, temperature)
    return tuple(_ce.exchange_cross_entropy(local, group_name, temperature))


@torch.library.custom_op("compiled_logprob::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    target_shift: torch.Tensor,
    target_log_norm: torch.Tensor,
    cross_entropy: torch.Tensor,
    *,
    wrt_target: bool,
    chunk_size: int | None,
) -> torch.Tensor:
    saved = CrossEntropyStats(shift, log_norm, target_shift, target_log_norm, cross_entropy)
    out = torch.empty_like(target_logits if wrt_target else logits, memory_format=torch.contiguous_format)
    # As the log-probs' backward: each block is formed in place in fp32, in the gradient
    # itself when it is fp32.
    in_out = out.dtype == torch.float32
    for block in seq_blocks(logits, chunk_size, workspace=not in_out, spare=True):
        out_block = out[:, block.rows]
        result = _ce.grad_cross_entropy(
            grad[:, block.rows],
            logits[:, block.rows],
            target_logits[:, block.rows],
            block_rows(temperature, block.rows),
            saved.block(block.rows),
            wrt_target=wrt_target,
            ops=Eager(out_block if in_out else block.workspace, block.spare),
        )
        if result is not out_block:
            out_block.copy_(result)
    return out


@cross_entropy_backward.register_fake
def _(grad, logits, target_logits, *rest, wrt_target, **options):
    wrt = target_logits if wrt_target else logits
    return torch.empty_like(wrt, memory_format=torch.contiguous_format)


@register_decomposition(torch.ops.compiled_logprob.cross_entropy_backward.default)
def _decompose_cross_entropy_backward(
    grad, logits, target_logits, temperature, *saved, wrt_target, chunk_size
):
    gradient = _ce.grad_cross_entropy(
        grad, logits, target_logits, temperature, CrossEntropyStats(*saved), wrt_target=wrt_target
    )
    return gradient.to((target_logits if wrt_target else logits).dtype)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target_logits, temperature = inputs
    result = CrossEntropyStats(*output)
    # Only the cross-entropy is an output of the public function.
    ctx.mark_non_differentiable(
        result.shift, result.log_norm, result.target_shift, result.target_log_norm
    )
    ctx.save_for_backward(logits, target_logits, temperature, *output)
    ctx.chunk_size = keyword_only_inputs["chunk_size"]


def _backward(ctx, _, __, ___, ____, grad):
    logits, target_logits, *saved = ctx.saved_tensors
    grads = [
        cross_entropy_backward(
            grad, logits, target_logits, *saved, wrt_target=wrt_target, chunk_size=ctx.chunk_size
        )
        if needed
        else None
        for wrt_target, needed in zip((False, True), ctx.needs_input_grad[:2])
    ]
    return *grads, None


cross_entropy_stats.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy_of(
    logits: torch.Tensor, target_logits: torch.Tensor, temperature: torch.Tensor | None, **options
) -> CrossEntropyStats:
    """:func:`cross_entropy_stats` with its outputs named."""
    return CrossEntropyStats(*cross_entropy_stats(logits, target_logits, temperature, **options))
