"""``compiled_logprob::vocab_parallel_stats`` and its backward: the full vocabulary's per-row
statistics of vocab-sharded logits (every token log-prob, logsumexp, entropy and top-k of
the package comes from them).

* ``vocab_parallel_stats(logits, target, temperature, *, vocab_start, group_name,
  ignore_index, with_entropy, topk, chunk_size, inplace_backward) -> Stats``: ``shift``, ``log_norm``, the
  targets' ``target_logit`` ``[B, S, K]``, the ``entropy`` (with ``with_entropy``) and, with
  ``topk`` > 0 (and no target), the global top ``topk`` as the targets, with their
  ``topk_ids`` (``_math.merge.Stats``). One all-gather of ``[B, S, F]`` statistics and one
  all-reduce of ``[B, S, 1|2]`` exact tile sums per call are all the communication.
* ``vocab_parallel_stats_backward``: the gradient of the differentiable outputs, written
  straight into one gradient buffer of the logits' dtype (with a ``threshold``, of the
  filtered softmax: ``filtering``'s backward too). No collective.
* ``vocab_parallel_stats_backward_``: the same written into the saved logits themselves, for
  ``inplace_backward`` (the caller has promised not to read the logits again): training
  needs no gradient buffer of the logits' size. It has no decomposition: Inductor would
  form the gradient in a fresh buffer and copy it back, so compiled graphs run its eager,
  block-by-block kernel in place.
"""

from __future__ import annotations

from typing import cast

import torch

from compiled_logprob._math import grad as _grad
from compiled_logprob._math import merge, stats, tiles
from compiled_logprob._math import topk as _topk
from compiled_logprob._math.kernels import Eager, block_rows
from compiled_logprob._math.merge import Stats
from compiled_logprob._ops.blocks import seq_blocks
from compiled_logprob._torch_compat import register_decomposition


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats", mutates_args=())
def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    with_entropy: bool,
    topk: int,
    chunk_size: int | None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert not (topk and target is not None), "the top-k are the targets"
    extra = []
    if target is not None:
        # K entries per row: one gather for all rows, not a few small ops per block.
        extra = [stats.target_stats(logits, target, vocab_start)]
    elif topk:
        # One selection for all rows (or per chunk).
        step = chunk_size or max(logits.shape[1], 1)
        extra = [
            torch.cat([
                _topk.topk_stats(logits[:, start : start + step], topk, vocab_start)
                for start in range(0, max(logits.shape[1], 1), step)
            ], dim=1)
        ]
    local = stats.with_rows(_eager_tiles(logits, temperature, with_entropy, chunk_size), None)
    result = merge.exchange_stats(
        stats.LocalStats(torch.cat([local.rows, *extra], dim=-1), local.tiles),
        target,
        group_name,
        ignore_index,
        temperature=temperature,
        with_entropy=with_entropy,
        topk=topk,
    )
    return (*result,)  # the schema's plain tuple, not the NamedTuple


def _eager_tiles(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    with_entropy: bool,
    chunk_size: int | None,
) -> torch.Tensor:
    """``stats.tile_stats`` of ``logits`` ``[B, S, V_local]``, eager: the whole tiles block by
    block in the reused buffers; the narrower last tile (a small share of the logits) per
    chunk, not per block, where a handful of small ops per block would cost more than it."""
    whole = tiles.whole_width(logits.shape[-1])
    parts = []
    if whole:
        head = logits[..., :whole]
        parts.append(torch.cat([
            stats.tile_stats(
                head[:, block.rows],
                temperature=block_rows(temperature, block.rows),
                with_entropy=with_entropy,
                ops=Eager(block.workspace, block.spare),
            )
            for block in seq_blocks(head, chunk_size, spare=with_entropy)
        ], dim=1))
    if whole < logits.shape[-1]:
        step = chunk_size or max(logits.shape[1], 1)
        parts.append(torch.cat([
            stats.tile_stats(
                logits[:, start : start + step, whole:],
                temperature=block_rows(temperature, slice(start, start + step)),
                with_entropy=with_entropy,
                ops=Eager(),
            )
            for start in range(0, max(logits.shape[1], 1), step)
        ], dim=1))
    return torch.cat(parts, dim=-2)


@vocab_parallel_stats.register_fake
def _(logits, target, temperature, *, topk, **options):
    return tuple(merge.empty_stats(logits, target, topk))


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats.default)
def _decompose_stats(
    logits, target, temperature, *, vocab_start, group_name, ignore_index, with_entropy, topk,
    chunk_size, inplace_backward=False,
):
    local = stats.local_stats(
        logits, target, vocab_start, temperature=temperature, with_entropy=with_entropy
    )
    candidates = [_topk.topk_stats(logits, topk, vocab_start)] if topk else []
    rows = torch.cat([local.rows, *candidates], dim=-1)
    return tuple(
        merge.exchange_stats(
            stats.LocalStats(rows, local.tiles), target, group_name, ignore_index,
            temperature=temperature, with_entropy=with_entropy, topk=topk,
        )
    )


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_backward", mutates_args=())
def vocab_parallel_stats_backward(
    grad_log_norm: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor | None,
    threshold: torch.Tensor | None,
    *,
    vocab_start: int,
    ignore_index: int | None,
    chunk_size: int | None,
) -> torch.Tensor:
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    grads = _grad.RowGrads(grad_log_norm, grad_target_logit, grad_entropy)
    saved = _grad.RowStats(shift, log_norm, temperature, entropy, threshold)
    _backward_into(grad, grads, saved, logits, target, vocab_start, ignore_index, chunk_size)
    return grad


def _backward_into(
    grad: torch.Tensor,
    grads: _grad.RowGrads,
    saved: _grad.RowStats,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    ignore_index: int | None,
    chunk_size: int | None,
) -> None:
    """The eager backward, block by block into ``grad`` (which may be ``logits`` itself:
    each block is read whole before it is written)."""
    # Each block's gradient is formed in place in fp32: in the gradient itself when it is
    # fp32 and not the logits, else in a workspace, rounded once by the copy into it.
    in_grad = grad.dtype == torch.float32 and grad is not logits
    one_hot = None
    if target is not None:
        # The one-hot terms' [B, S, K] operands, formed once rather than block by block.
        one_hot = _grad.target_terms(
            grads.target_logit, target, vocab_start, logits.shape[-1], ignore_index, saved.temperature
        )
    blocks = seq_blocks(logits, chunk_size, workspace=not in_grad, spare=grads.entropy is not None)
    for block in blocks:
        out = grad[:, block.rows]
        ops = Eager(out if in_grad else block.workspace, block.spare)
        result = _grad.grad_logits(
            grads.block(block.rows), saved.block(block.rows), logits[:, block.rows], None,
            vocab_start, ignore_index, ops=ops,
        )
        if one_hot is not None:
            index, grad_target, all_ignored = one_hot
            result = _grad.add_target_terms_(
                result,
                block_rows(index, block.rows),
                block_rows(grad_target, block.rows),
                block_rows(all_ignored, block.rows),
            )
        if result is not out:
            out.copy_(result)


@vocab_parallel_stats_backward.register_fake
def _(grad_log_norm, grad_target_logit, grad_entropy, logits, *rest, **options):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats_backward.default)
def _decompose_backward(
    grad_log_norm, grad_target_logit, grad_entropy, logits, target, temperature, shift,
    log_norm, entropy, threshold, *, vocab_start, ignore_index, chunk_size,
):
    return _grad.grad_logits(
        _grad.RowGrads(grad_log_norm, grad_target_logit, grad_entropy),
        _grad.RowStats(shift, log_norm, temperature, entropy, threshold),
        logits,
        target,
        vocab_start,
        ignore_index,
    )


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_backward_", mutates_args=("logits",))
def vocab_parallel_stats_backward_(
    grad_log_norm: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor | None,
    threshold: torch.Tensor | None,
    *,
    vocab_start: int,
    ignore_index: int | None,
    chunk_size: int | None,
) -> None:
    grads = _grad.RowGrads(grad_log_norm, grad_target_logit, grad_entropy)
    saved = _grad.RowStats(shift, log_norm, temperature, entropy, threshold)
    _backward_into(logits, grads, saved, logits, target, vocab_start, ignore_index, chunk_size)


@vocab_parallel_stats_backward_.register_fake
def _(*args, **options):
    return None


def logits_grad(ctx, *args: torch.Tensor | None) -> torch.Tensor:
    """The backward op of ``args`` (``vocab_parallel_stats_backward``'s), or with
    ``ctx.inplace_backward`` its in-place twin: the gradient written into the saved logits
    (``args[3]``), which are then the gradient."""
    if ctx.inplace_backward:
        vocab_parallel_stats_backward_(*args, **ctx.options)
        return cast(torch.Tensor, args[3])
    return vocab_parallel_stats_backward(*args, **ctx.options)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target, temperature = inputs
    result = Stats(*output)
    # The shift only centres the others, which are invariant to it: they carry all the
    # gradient, with the shift held constant.
    ctx.mark_non_differentiable(result.shift, result.verdict)
    if keyword_only_inputs["topk"]:
        target = result.topk_ids
    ctx.save_for_backward(logits, target, temperature, result.shift, result.log_norm, result.entropy)
    ctx.options = {
        name: keyword_only_inputs[name] for name in ("vocab_start", "ignore_index", "chunk_size")
    }
    ctx.with_entropy = keyword_only_inputs["with_entropy"]
    ctx.inplace_backward = keyword_only_inputs.get("inplace_backward", False)


def _backward(ctx, _, grad_log_norm, grad_target_logit, grad_entropy, __, ___):
    logits, target, temperature, shift, log_norm, entropy = ctx.saved_tensors
    grad = logits_grad(
        ctx,
        grad_log_norm,
        grad_target_logit,
        grad_entropy if ctx.with_entropy else None,
        logits,
        target,
        temperature,
        shift,
        log_norm,
        entropy,
        None,
    )
    return grad, None, None


vocab_parallel_stats.register_autograd(_backward, setup_context=_setup_context)


def stats_of(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    **options,
) -> Stats:
    """:func:`vocab_parallel_stats` with its outputs named."""
    return Stats(*vocab_parallel_stats(logits, target, temperature, **options))
