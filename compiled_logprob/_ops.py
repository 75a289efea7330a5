"""Op registrations: schemas, fake kernels, autograd and Inductor decompositions.

Custom ops carry all the vocab-parallel math, with ``z = logits / temperature``:

* ``compiled_logprob::vocab_parallel_stats(logits, target, temperature, *, vocab_start,
  group_name, ignore_index, with_entropy, topk, chunk_size) -> (shift, log_total,
  target_logit, entropy, topk_ids)``: the full vocabulary's row max ``shift`` ``[B, S]``
  (unscaled; not differentiable) and ``log_total = lse − shift / temperature`` ``[B, S]``,
  the targets' ``z − shift / temperature`` ``[B, S, K]`` and, with entropy, the entropy
  ``[B, S]``; all fp32 (see ``_math.exchange_stats``). With ``topk`` > 0 (and no target)
  the targets are the global top ``topk``, found in the same pass: ``topk_ids``
  ``[B, S, topk]`` (int64) and their logits. One all-gather of ``[B, S, F]`` statistics per
  call is the only communication.
* ``compiled_logprob::vocab_parallel_stats_backward``: the gradient of the three
  differentiable fp32 outputs, written straight into one gradient buffer of the logits'
  dtype (with a ``threshold``, of the filtered softmax). No collective.
* ``compiled_logprob::filtered_stats(logits, target, temperature, *, vocab_start,
  group_name, ignore_index, top_k, top_p, chunk_size) -> (shift, log_total, target_logit,
  threshold)``: the same statistics over the ids that top-k/top-p filtering keeps
  (``_math.filtered_stats``): one all-to-all of the logits to whole rows and one all-gather
  of per-row statistics (per chunk in eager). Its backward is the one above.

* ``compiled_logprob::cross_entropy_stats(logits, target_logits, temperature, *, group_name,
  chunk_size) -> (shift, log_total, target_shift, target_log_total, cross_entropy)``: the
  cross-entropy ``H(p, q)`` ``[B, S]`` of ``p = softmax(target_logits / T)`` relative to
  ``q = softmax(logits / T)`` (a distillation loss), with the per-row statistics of both
  softmaxes (``_math.exchange_cross_entropy``): one all-gather of ``[B, S, 5]``. Its backward,
  ``compiled_logprob::cross_entropy_backward``, gives either input's gradient, with no
  collective.

Eager kernels walk the sequence in blocks (of at most ``chunk_size`` positions when it is
given) so that no temporary outgrows a block. Under Inductor both ops decompose into the
loop-free math of ``_math``, each becoming one fused pass over the logits that keeps no
``[B, S, V_local]`` temporary at all, so ``chunk_size`` has nothing left to bound there.
"""

from __future__ import annotations

import torch
from torch._inductor.decomposition import register_decomposition

from compiled_logprob import _math

# Eager kernels walk the sequence in blocks of at least min_block_elements(device) elements
# (or one row), enough to amortise per-op overhead, and at most BLOCKS_PER_CALL blocks per
# call (per block-sized temporary: two temporaries share the cache), so that large logits do
# not pay thousands of per-op thread wake-ups. On CPU a block's fp32 temporaries stay in
# cache and under ~1.6% of the logits (bf16) on large inputs. On a GPU an op over a small
# block ends before the host has launched the next (~10 µs each), so the host would set the
# pace (~20× slower than the seed on an H200 with CPU-sized blocks): blocks of 2^24 elements
# take ~40 µs per pass at HBM bandwidth, for a fixed 64 MiB per fp32 temporary.
BLOCKS_PER_CALL = 256
MIN_BLOCK_ELEMENTS = 1 << 18
MIN_BLOCK_ELEMENTS_GPU = 1 << 24
# The eager filtering kernels select from whole rows (V entries) in blocks of about
# min_block_elements(device), and at least MIN_FILTER_ROWS rows: fewer rows pay more in
# per-op overhead than their smaller temporaries save (measured on CPU, V = 32000 and 152064).
MIN_FILTER_ROWS = 8


def min_block_elements(device: torch.device) -> int:
    """Elements per eager block, at least, on ``device`` (see above)."""
    return MIN_BLOCK_ELEMENTS if device.type == "cpu" else MIN_BLOCK_ELEMENTS_GPU


def _seq_blocks(
    logits: torch.Tensor, chunk_size: int | None, *, workspace: bool = True, spare: bool = False
) -> list[tuple[slice, torch.Tensor | None, torch.Tensor | None]]:
    """The eager kernels' blocks of sequence positions of ``logits`` ``[B, S, V_local]``,
    each with its views of the fp32 ``workspace`` and (for the entropy's second block-sized
    temporary) of a ``spare`` one, when asked for, which all the blocks reuse."""
    batch, seq_len, vocab = logits.shape
    row = max(1, batch * vocab)
    temporaries = max(1, workspace + spare)
    block_elements = max(
        min_block_elements(logits.device), row * seq_len // (BLOCKS_PER_CALL * temporaries)
    )
    block = max(1, min(seq_len, block_elements // row, chunk_size or seq_len))
    buffers = logits.new_empty(
        (workspace + spare, batch, min(block, seq_len), vocab), dtype=torch.float32
    )
    # At least one (possibly empty) block: an empty sequence still joins the collective.
    blocks = []
    for start in range(0, max(seq_len, 1), block):
        views = iter(buffers[:, :, : min(block, seq_len - start)])
        blocks.append((
            slice(start, start + block),
            next(views) if workspace else None,
            next(views) if spare else None,
        ))
    return blocks


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert not (topk and target is not None), "the top-k are the targets"
    extra, row_max = [], None
    if target is not None:
        # K entries per row: one gather for all rows, not a few small ops per block.
        extra = [_math.target_stats(logits, target, vocab_start)]
    elif topk:
        # One selection for all rows (or per chunk: its block maxima are V_local / 16 per
        # row); the maxima give the row max and spare the blocks their max pass.
        step = chunk_size or max(logits.shape[1], 1)
        parts = [
            _math.topk_stats(logits[:, start : start + step], topk, vocab_start)
            for start in range(0, max(logits.shape[1], 1), step)
        ]
        extra = [torch.cat([candidates for candidates, _ in parts], dim=1)]
        row_max = torch.cat([row_max for _, row_max in parts], dim=1)
    stats = torch.cat(
        [
            _math.local_stats(
                logits[:, rows],
                None,
                vocab_start,
                temperature=_math.block_rows(temperature, rows),
                with_entropy=with_entropy,
                row_max=_math.block_rows(row_max, rows),
                eager=True,
                workspace=workspace,
                spare=spare,
            )
            for rows, workspace, spare in _seq_blocks(logits, chunk_size, spare=with_entropy)
        ],
        dim=1,
    )
    return _math.exchange_stats(
        torch.cat([stats, *extra], dim=-1),
        target,
        group_name,
        ignore_index,
        temperature=temperature,
        with_entropy=with_entropy,
        topk=topk,
    )


@vocab_parallel_stats.register_fake
def _(logits, target, temperature, *, topk, **options):
    return _math.empty_exchanged_stats(logits, target, topk)


@torch.library.custom_op("compiled_logprob::vocab_parallel_stats_backward", mutates_args=())
def vocab_parallel_stats_backward(
    grad_log_total: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_total: torch.Tensor,
    entropy: torch.Tensor | None,
    threshold: torch.Tensor | None,
    *,
    vocab_start: int,
    ignore_index: int | None,
    chunk_size: int | None,
) -> torch.Tensor:
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    # Each block's gradient is formed in place in fp32: in the gradient itself when it is
    # fp32, else in a workspace, rounded once by the copy into the gradient.
    in_grad = grad.dtype == torch.float32
    blocks = _seq_blocks(
        logits, chunk_size, workspace=not in_grad, spare=grad_entropy is not None
    )
    one_hot = None
    if target is not None:
        # The one-hot terms' [B, S, K] operands, formed once rather than block by block.
        one_hot = _math.target_terms(
            grad_target_logit, target, vocab_start, logits.shape[-1], ignore_index, temperature
        )
    for rows, workspace, spare in blocks:
        out = grad[:, rows]
        block = _math.grad_logits(
            grad_log_total[:, rows],
            grad_target_logit[:, rows],
            logits[:, rows],
            None,
            shift[:, rows],
            log_total[:, rows],
            vocab_start,
            ignore_index,
            temperature=_math.block_rows(temperature, rows),
            grad_entropy=_math.block_rows(grad_entropy, rows),
            entropy=_math.block_rows(entropy, rows),
            threshold=_math.block_rows(threshold, rows),
            eager=True,
            workspace=out if in_grad else workspace,
            spare=spare,
        )
        if one_hot is not None:
            terms = (_math.block_rows(term, rows) for term in one_hot)
            block = _math.add_target_terms_(block, *terms)
        if block is not out:
            out.copy_(block)
    return grad


@vocab_parallel_stats_backward.register_fake
def _(grad_log_total, grad_target_logit, grad_entropy, logits, *rest, **options):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    logits, target, temperature = inputs
    shift, log_total, _, entropy, topk_ids = output
    # The shift only centres the others, which are invariant to it: they carry all the
    # gradient, with the shift held constant.
    ctx.mark_non_differentiable(shift)
    if keyword_only_inputs["topk"]:
        target = topk_ids
    ctx.save_for_backward(logits, target, temperature, shift, log_total, entropy)
    ctx.options = {
        name: keyword_only_inputs[name] for name in ("vocab_start", "ignore_index", "chunk_size")
    }
    ctx.with_entropy = keyword_only_inputs["with_entropy"]


def _backward(ctx, _, grad_log_total, grad_target_logit, grad_entropy, __):
    logits, target, temperature, shift, log_total, entropy = ctx.saved_tensors
    grad = vocab_parallel_stats_backward(
        grad_log_total,
        grad_target_logit,
        grad_entropy if ctx.with_entropy else None,
        logits,
        target,
        temperature,
        shift,
        log_total,
        entropy,
        None,
        **ctx.options,
    )
    return grad, None, None


vocab_parallel_stats.register_autograd(_backward, setup_context=_setup_context)


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats.default)
def _decompose_stats(
    logits,
    target,
    temperature,
    *,
    vocab_start,
    group_name,
    ignore_index,
    with_entropy,
    topk,
    chunk_size,
):
    candidates, row_max = None, None
    if topk:
        candidates, row_max = _math.topk_stats(logits, topk, vocab_start)
    stats = _math.local_stats(
        logits,
        target,
        vocab_start,
        temperature=temperature,
        with_entropy=with_entropy,
        row_max=row_max,
    )
    if topk:
        stats = torch.cat([stats, candidates], dim=-1)
    return _math.exchange_stats(
        stats,
        target,
        group_name,
        ignore_index,
        temperature=temperature,
        with_entropy=with_entropy,
        topk=topk,
    )


@register_decomposition(torch.ops.compiled_logprob.vocab_parallel_stats_backward.default)
def _decompose_backward(
    grad_log_total,
    grad_target_logit,
    grad_entropy,
    logits,
    target,
    temperature,
    shift,
    log_total,
    entropy,
    threshold,
    *,
    vocab_start,
    ignore_index,
    chunk_size,
):
    return _math.grad_logits(
        grad_log_total,
        grad_target_logit,
        logits,
        target,
        shift,
        log_total,
        vocab_start,
        ignore_index,
        temperature=temperature,
        grad_entropy=grad_entropy,
        entropy=entropy,
        threshold=threshold,
    )


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Each block of chunk_size positions trades its own whole rows (two collectives per
    # block); the selection then walks them a few rows at a time, its temporaries in cache.
    step = chunk_size or max(logits.shape[1], 1)
    vocab = logits.shape[-1] * _math._size_rank(group_name)[0]
    block_rows = max(MIN_FILTER_ROWS, min_block_elements(logits.device) // vocab)
    blocks = [
        _math.filtered_stats(
            logits[:, start : start + step],
            target[:, start : start + step],
            _math.block_rows(temperature, slice(start, start + step)),
            group_name,
            ignore_index,
            top_k=top_k,
            top_p=top_p,
            block_rows=block_rows,
        )
        for start in range(0, max(logits.shape[1], 1), step)
    ]
    return tuple(torch.cat(parts, dim=1) for parts in zip(*blocks))


@filtered_stats.register_fake
def _(logits, target, temperature, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    target_logit = torch.empty_like(target, dtype=torch.float32)
    return row, torch.empty_like(row), target_logit, torch.empty_like(row)


def _setup_filtered(ctx, inputs, keyword_only_inputs, output):
    logits, target, temperature = inputs
    shift, log_total, _, threshold = output
    ctx.mark_non_differentiable(shift, threshold)
    ctx.save_for_backward(logits, target, temperature, shift, log_total, threshold)
    ctx.options = {
        name: keyword_only_inputs[name] for name in ("vocab_start", "ignore_index", "chunk_size")
    }


def _filtered_backward(ctx, _, grad_log_total, grad_target_logit, __):
    logits, target, temperature, shift, log_total, threshold = ctx.saved_tensors
    grad = vocab_parallel_stats_backward(
        grad_log_total,
        grad_target_logit,
        None,
        logits,
        target,
        temperature,
        shift,
        log_total,
        None,
        threshold,
        **ctx.options,
    )
    return grad, None, None


filtered_stats.register_autograd(_filtered_backward, setup_context=_setup_filtered)


@register_decomposition(torch.ops.compiled_logprob.filtered_stats.default)
def _decompose_filtered(
    logits, target, temperature, *, vocab_start, group_name, ignore_index, top_k, top_p, chunk_size
):
    return _math.filtered_stats(
        logits, target, temperature, group_name, ignore_index, top_k=top_k, top_p=top_p
    )


@torch.library.custom_op("compiled_logprob::cross_entropy_stats", mutates_args=())
def cross_entropy_stats(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    group_name: str | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = torch.cat(
        [
            _math.cross_entropy_stats(
                logits[:, rows],
                target_logits[:, rows],
                _math.block_rows(temperature, rows),
                eager=True,
                workspace=workspace,
                spare=spare,
            )
            for rows, workspace, spare in _seq_blocks(logits, chunk_size, spare=True)
        ],
        dim=1,
    )
    return _math.exchange_cross_entropy(stats, group_name, temperature)


@cross_entropy_stats.register_fake
def _(logits, target_logits, temperature, **options):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return tuple(torch.empty_like(row) for _ in range(5))


@torch.library.custom_op("compiled_logprob::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_total: torch.Tensor,
    target_shift: torch.Tensor,
    target_log_total: torch.Tensor,
    cross_entropy: torch.Tensor,
    *,
    wrt_target: bool,
    chunk_size: int | None,
) -> torch.Tensor:
    wrt = target_logits if wrt_target else logits
    out = torch.empty_like(wrt, memory_format=torch.contiguous_format)
    # As vocab_parallel_stats_backward: each block is formed in place in fp32, in the
    # gradient itself when it is fp32.
    in_out = out.dtype == torch.float32
    stats = (shift, log_total, target_shift, target_log_total, cross_entropy)
    for rows, workspace, spare in _seq_blocks(logits, chunk_size, workspace=not in_out, spare=True):
        out_block = out[:, rows]
        block = _math.grad_cross_entropy(
            grad[:, rows],
            logits[:, rows],
            target_logits[:, rows],
            _math.block_rows(temperature, rows),
            *(_math.block_rows(row, rows) for row in stats),
            wrt_target=wrt_target,
            eager=True,
            workspace=out_block if in_out else workspace,
            spare=spare,
        )
        if block is not out_block:
            out_block.copy_(block)
    return out


@cross_entropy_backward.register_fake
def _(grad, logits, target_logits, *rest, wrt_target, **options):
    wrt = target_logits if wrt_target else logits
    return torch.empty_like(wrt, memory_format=torch.contiguous_format)


def _setup_cross_entropy(ctx, inputs, keyword_only_inputs, output):
    logits, target_logits, temperature = inputs
    shift, log_total, target_shift, target_log_total, _ = output
    # Only the cross-entropy is an output of the public function; the others are its
    # per-row statistics, saved for backward.
    ctx.mark_non_differentiable(shift, log_total, target_shift, target_log_total)
    ctx.save_for_backward(logits, target_logits, temperature, *output)
    ctx.chunk_size = keyword_only_inputs["chunk_size"]


def _cross_entropy_backward(ctx, _, __, ___, ____, grad):
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


cross_entropy_stats.register_autograd(_cross_entropy_backward, setup_context=_setup_cross_entropy)


@register_decomposition(torch.ops.compiled_logprob.cross_entropy_stats.default)
def _decompose_cross_entropy(logits, target_logits, temperature, *, group_name, chunk_size):
    stats = _math.cross_entropy_stats(logits, target_logits, temperature)
    return _math.exchange_cross_entropy(stats, group_name, temperature)


@register_decomposition(torch.ops.compiled_logprob.cross_entropy_backward.default)
def _decompose_cross_entropy_backward(
    grad, logits, target_logits, temperature, *stats, wrt_target, chunk_size
):
    gradient = _math.grad_cross_entropy(
        grad, logits, target_logits, temperature, *stats, wrt_target=wrt_target
    )
    return gradient.to((target_logits if wrt_target else logits).dtype)
