"""Op registrations: schemas, fake kernels, autograd and Inductor decompositions.

Custom ops carry all the vocab-parallel math, with ``z = logits / temperature``:

* ``compiled_logprob::vocab_parallel_stats(logits, target, temperature, *, vocab_start,
  group_name, ignore_index, with_entropy) -> (lse, target_logit, mean_logit)``: the
  full-vocabulary logsumexp ``[B, S]``, the targets' logits ``[B, S, K]`` and, with entropy,
  ``E_softmax[z]`` ``[B, S]``; all fp32. One all-gather of ``[F, B, S]`` statistics per call
  is the only communication.
* ``compiled_logprob::vocab_parallel_stats_chunked``: the same with one all-gather per
  sequence chunk of ``chunk_size`` positions.
* ``compiled_logprob::vocab_parallel_stats_backward``: the gradient of all three outputs,
  written straight into one gradient buffer of the logits' dtype. No collective.

Eager kernels walk the sequence in blocks so that no temporary outgrows a block. Under
Inductor the unchunked forward and the backward decompose into the loop-free math of
``_math``, each becoming one fused pass over the logits; the chunked forward stays opaque,
so its Python loop over chunks is never unrolled into the graph.
"""

from __future__ import annotations

import torch
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


def _rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[:, rows]


def _gather_and_combine(stats, target, group_name, ignore_index, with_entropy):
    gathered = _math.gather_stats(stats, group_name)
    return _math.combine_stats(gathered, target, ignore_index, with_entropy=with_entropy)


def _local_stats(logits, target, temperature, rows, vocab_start, with_entropy, eager):
    return _math.local_stats(
        logits[:, rows],
        _rows(target, rows),
        vocab_start,
        temperature=_rows(temperature, rows),
        with_entropy=with_entropy,
        eager=eager,
    )


def _stats_whole(
    logits, target, temperature, vocab_start, group_name, ignore_index, with_entropy, eager
):
    stats = _local_stats(
        logits, target, temperature, slice(None), vocab_start, with_entropy, eager
    )
    return _gather_and_combine(stats, target, group_name, ignore_index, with_entropy)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq_len, vocab = logits.shape
    stats = [
        _local_stats(logits, target, temperature, rows, vocab_start, with_entropy, True)
        for rows in _seq_blocks(seq_len, _block_len(batch, seq_len, vocab))
    ]
    return _gather_and_combine(
        torch.cat(stats, dim=1), target, group_name, ignore_index, with_entropy
    )


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_chunked", mutates_args=())
def vocab_parallel_stats_chunked(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # One collective per chunk keeps every temporary O(B * chunk_size * V_local).
    per_chunk = [
        _stats_whole(
            logits[:, rows],
            _rows(target, rows),
            _rows(temperature, rows),
            vocab_start,
            group_name,
            ignore_index,
            with_entropy,
            eager=True,
        )
        for rows in _seq_blocks(logits.shape[1], chunk_size)
    ]
    return tuple(torch.cat(pieces, dim=1) for pieces in zip(*per_chunk))


def _fake_stats(logits, target, temperature, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    k = 0 if target is None else target.shape[-1]
    return row, logits.new_empty(*logits.shape[:-1], k, dtype=torch.float32), torch.empty_like(row)


vocab_parallel_stats.register_fake(_fake_stats)
vocab_parallel_stats_chunked.register_fake(_fake_stats)


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_backward", mutates_args=())
def vocab_parallel_stats_backward(
    grad_lse: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_mean_logit: torch.Tensor | None,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
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
            temperature=_rows(temperature, rows),
            grad_mean_logit=_rows(grad_mean_logit, rows),
            mean_logit=mean_logit[:, rows],
            eager=True,
        )
    return grad


@vocab_parallel_stats_backward.register_fake
def _(grad_lse, grad_target_logit, grad_mean_logit, logits, *rest, **options):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target, temperature = inputs
    lse, _, mean_logit = output
    ctx.save_for_backward(logits, target, temperature, lse, mean_logit)
    ctx.vocab_start = keyword_only_inputs["vocab_start"]
    ctx.ignore_index = keyword_only_inputs["ignore_index"]
    ctx.with_entropy = keyword_only_inputs["with_entropy"]


def _backward(ctx, grad_lse, grad_target_logit, grad_mean_logit):
    logits, target, temperature, lse, mean_logit = ctx.saved_tensors
    grad = vocab_parallel_stats_backward(
        grad_lse,
        grad_target_logit,
        grad_mean_logit if ctx.with_entropy else None,
        logits,
        target,
        temperature,
        lse,
        mean_logit,
        vocab_start=ctx.vocab_start,
        ignore_index=ctx.ignore_index,
    )
    return grad, None, None


vocab_parallel_stats.register_autograd(_backward, setup_context=_setup_context)
vocab_parallel_stats_chunked.register_autograd(_backward, setup_context=_setup_context)


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats.default)
def _decompose_stats(logits, target, temperature, *, vocab_start, group_name, ignore_index, with_entropy):
    return _stats_whole(
        logits, target, temperature, vocab_start, group_name, ignore_index, with_entropy,
        eager=False,
    )


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats_backward.default)
def _decompose_backward(
    grad_lse,
    grad_target_logit,
    grad_mean_logit,
    logits,
    target,
    temperature,
    lse,
    mean_logit,
    *,
    vocab_start,
    ignore_index,
):
    return _math.grad_logits(
        grad_lse,
        grad_target_logit,
        logits,
        target,
        lse,
        vocab_start,
        ignore_index,
        temperature=temperature,
        grad_mean_logit=grad_mean_logit,
        mean_logit=mean_logit,
    ).to(logits.dtype)
