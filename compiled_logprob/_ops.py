"""Op registrations: schemas, fake kernels, autograd and Inductor decompositions.

Two custom ops carry all the vocab-parallel math:

* ``compiled_logprob::vocab_parallel_stats(logits, target, *, vocab_start, group_name,
  chunk_size, ignore_index) -> (lse, target_logit)``: the full-vocabulary logsumexp and the
  target's logit per row, fp32 ``[B, S]``. One all-gather of ``[K, B, S]`` statistics per
  call (per chunk when ``chunk_size`` is set) is the only communication.
* ``compiled_logprob::vocab_parallel_stats_backward``: ``g_lse · softmax + g_target · onehot``
  written straight into one gradient buffer of the logits' dtype. No collective.

Eager kernels walk the sequence in blocks so that no temporary outgrows a block. Under
Inductor both ops decompose into the loop-free math of ``_math`` so that each becomes one
fused pass over the logits; the chunked forward stays opaque, so its Python loop over
chunks is never unrolled into the graph.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch._inductor.decomposition import register_decomposition

from compiled_logprob import _math

# Eager kernels walk the sequence in blocks of at least MIN_BLOCK_ELEMENTS elements (or one
# row), enough to amortise per-op overhead, and at most BLOCKS_PER_CALL blocks per call, so
# that large logits do not pay thousands of per-op thread wake-ups (CPU) or launches (GPU).
# A block's fp32 temporaries stay under ~1.6% of the logits (bf16) on large inputs.
BLOCKS_PER_CALL = 256
MIN_BLOCK_ELEMENTS = 1 << 18


def _block_len(batch: int, seq_len: int, vocab: int) -> int:
    row = max(1, batch * vocab)
    block_elements = max(MIN_BLOCK_ELEMENTS, row * seq_len // BLOCKS_PER_CALL)
    return max(1, min(seq_len, block_elements // row))


def _seq_blocks(seq_len: int, block: int) -> list[slice]:
    # At least one (possibly empty) block: an empty sequence still joins the collective.
    return [slice(s, s + block) for s in range(0, max(seq_len, 1), block)]


def _rows(target: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if target is None else target[:, rows]


def _gather_and_combine(
    stats: torch.Tensor,
    target: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if group_name is None:
        gathered = stats.unsqueeze(0)
    else:
        gathered = funcol.all_gather_single(stats, 0, group_name)
        gathered = gathered.unflatten(0, (-1, stats.shape[0]))
    return _math.combine_stats(gathered, target, ignore_index)


def _stats_whole(logits, target, vocab_start, group_name, ignore_index):
    stats = _math.local_stats(logits, target, vocab_start)
    return _gather_and_combine(stats, target, group_name, ignore_index)


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats", mutates_args=())
def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, vocab = logits.shape
    blocks = _seq_blocks(seq_len, _block_len(batch, seq_len, vocab))
    stats = [_math.local_stats(logits[:, rows], _rows(target, rows), vocab_start) for rows in blocks]
    return _gather_and_combine(torch.cat(stats, dim=-1), target, group_name, ignore_index)


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_chunked", mutates_args=())
def vocab_parallel_stats_chunked(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One collective per chunk keeps every temporary O(B * chunk_size * V_local).
    per_chunk = [
        _stats_whole(logits[:, rows], _rows(target, rows), vocab_start, group_name, ignore_index)
        for rows in _seq_blocks(logits.shape[1], chunk_size)
    ]
    lse, target_logit = zip(*per_chunk)
    return torch.cat(lse, dim=1), torch.cat(target_logit, dim=1)


def _fake_stats(logits, target, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return row, torch.empty_like(row)


vocab_parallel_stats.register_fake(_fake_stats)
vocab_parallel_stats_chunked.register_fake(_fake_stats)


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_backward", mutates_args=())
def vocab_parallel_stats_backward(
    grad_lse: torch.Tensor,
    grad_target_logit: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    lse: torch.Tensor,
    *,
    vocab_start: int,
    ignore_index: int | None,
) -> torch.Tensor:
    batch, seq_len, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    for rows in _seq_blocks(seq_len, _block_len(batch, seq_len, vocab)):
        grad[:, rows] = _math.grad_logits(
            grad_lse[:, rows],
            grad_target_logit[:, rows],
            logits[:, rows],
            _rows(target, rows),
            lse[:, rows],
            vocab_start,
            ignore_index,
        )
    return grad


@vocab_parallel_stats_backward.register_fake
def _(grad_lse, grad_target_logit, logits, target, lse, *, vocab_start, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target = inputs
    ctx.save_for_backward(logits, target, output[0])
    ctx.vocab_start = keyword_only_inputs["vocab_start"]
    ctx.ignore_index = keyword_only_inputs["ignore_index"]


def _backward(ctx, grad_lse, grad_target_logit):
    logits, target, lse = ctx.saved_tensors
    grad = vocab_parallel_stats_backward(
        grad_lse,
        grad_target_logit,
        logits,
        target,
        lse,
        vocab_start=ctx.vocab_start,
        ignore_index=ctx.ignore_index,
    )
    return grad, None


vocab_parallel_stats.register_autograd(_backward, setup_context=_setup_context)
vocab_parallel_stats_chunked.register_autograd(_backward, setup_context=_setup_context)


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats.default)
def _decompose_stats(logits, target, *, vocab_start, group_name, ignore_index):
    return _stats_whole(logits, target, vocab_start, group_name, ignore_index)


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats_backward.default)
def _decompose_backward(
    grad_lse, grad_target_logit, logits, target, lse, *, vocab_start, ignore_index
):
    return _math.grad_logits(
        grad_lse, grad_target_logit, logits, target, lse, vocab_start, ignore_index
    )
