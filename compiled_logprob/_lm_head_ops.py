"""Op registrations for token log-probs straight from hidden states (no logits tensor).

* ``compiled_logprob::lm_head_stats(hidden, weight, target, temperature, *, vocab_start,
  group_name, ignore_index, chunk_size, with_entropy, topk) -> (shift, log_total,
  target_logit, entropy, topk_ids)``: per sequence chunk, the logits tile
  ``z = hidden @ weight.T / temperature`` (``temperature`` fp32 ``[B, S]``, or ``None`` for
  1), its per-row statistics and the logits of the targets ``[B, S, K]`` or, with ``topk``
  > 0 (and no target), of this shard's top ``topk`` (``_math.topk_stats``); one all-gather
  of the ``[B, S, F]`` statistics of the whole call over the TP group. The outputs are
  ``_math.exchange_stats``'s (a log-prob is ``target_logit − log_total``; ``shift`` is not
  differentiable); the entropy is 0 without ``with_entropy``. All fp32 ``[B, S]``, the
  target logits ``[B, S, K]`` (``K = topk`` with a top-k, whose int64 ids are
  ``topk_ids``).
* ``compiled_logprob::lm_head_stats_backward``: recomputes each tile, forms its gradient with
  ``_math.grad_logits`` and accumulates ``grad_hidden`` (chunk by chunk) and ``grad_weight``
  (summed over chunks in fp32); ``grad_hidden`` is then all-reduced over the TP group,
  because every rank's part covers only its vocabulary slice of the replicated hidden states.
  Only the gradients that autograd asks for are formed (the other is an empty tensor): a
  frozen LM head costs no fp32 ``[V_local, H]`` buffer and no second matmul per chunk.

Both stay opaque to the compiler (no decomposition), so their loops over chunks never unroll
into the graph and no ``[B, S, V_local]`` tensor exists anywhere: temporaries are
``O(B · chunk · V_local)`` fp32.

Shape legend: ``B`` batch, ``S`` sequence, ``H`` hidden size, ``V_local`` this rank's
vocabulary slice, ``R`` ranks of the vocab-parallel group, ``F`` statistics per row.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from compiled_logprob import _math

# Default chunk: positions such that one fp32 logits tile holds about this many elements
# (64 MiB); a handful of tile-sized temporaries then stay far below the logits path's peak
# while each chunk's matmul is still large enough to run at full speed.
TILE_ELEMENTS = 1 << 24


def _chunks(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | None, *, spare: bool
) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The chunks of sequence positions, each with its ``[B, c, V_local]`` views of buffers
    that every chunk reuses: the logits tile (the inputs' dtype), an fp32 workspace and,
    when asked for (the entropy's second temporary), an fp32 ``spare``. Fresh tile-sized
    temporaries would fault their pages in for every chunk."""
    batch, seq_len, _ = hidden.shape
    vocab = weight.shape[0]
    if chunk_size is None:
        chunk_size = max(1, TILE_ELEMENTS // max(1, batch * vocab))
    tile_elements = batch * min(chunk_size, max(seq_len, 1)) * vocab
    logits = hidden.new_empty(tile_elements)
    fp32 = hidden.new_empty((1 + spare) * tile_elements, dtype=torch.float32)

    def view(buffer: torch.Tensor, positions: int, index: int = 0) -> torch.Tensor:
        start = index * tile_elements
        return buffer[start : start + batch * positions * vocab].view(batch, positions, vocab)

    chunks = []
    # At least one (possibly empty) chunk: an empty sequence still joins the collective.
    for start in range(0, max(seq_len, 1), chunk_size):
        n = max(0, min(chunk_size, seq_len - start))
        chunks.append((
            slice(start, start + chunk_size), view(logits, n), view(fp32, n), view(fp32, n, 1) if spare else None
        ))
    return chunks


def _logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``[B, c, V_local]`` tile ``hidden @ weight.T`` in the inputs' dtype (written into
    ``out``), as the logits path computes its logits; the temperature and everything after
    it run in fp32 in ``_math``. One 2-D matmul: ``torch.matmul`` with ``out=`` takes a
    batched path with copies for a sliced ``hidden`` (8x slower in bf16)."""
    torch.mm(hidden.flatten(0, 1), weight.T, out=out.view(-1, weight.shape[0]))
    return out


@torch.library.custom_op("compiled_logprob::lm_head_stats", mutates_args=())
def lm_head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    chunk_size: int | None,
    with_entropy: bool,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (target is None) == (topk > 0), "the top-k are the targets"
    stats = []
    for rows, tile, workspace, spare in _chunks(hidden, weight, chunk_size, spare=with_entropy):
        tile = _logits(hidden[:, rows], weight, tile)
        candidates, row_max = [], None
        if topk:
            # The block maxima that select the tile's top-k also give its row max.
            top, row_max = _math.topk_stats(tile, topk, vocab_start)
            candidates = [top]
        tile_stats = _math.local_stats(
            tile,
            _math.block_rows(target, rows),
            vocab_start,
            temperature=_math.block_rows(temperature, rows),
            with_entropy=with_entropy,
            row_max=row_max,
            eager=True,
            workspace=workspace,
            spare=spare,
        )
        stats.append(torch.cat([tile_stats, *candidates], dim=-1))
    return _math.exchange_stats(
        torch.cat(stats, dim=1),
        target,
        group_name,
        ignore_index,
        temperature=temperature,
        with_entropy=with_entropy,
        topk=topk,
    )


@lm_head_stats.register_fake
def _(hidden, weight, target, temperature, *, topk, **options):
    return _math.empty_exchanged_stats(hidden, target, topk)


def _add_matmul(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, product: torch.Tensor | None
) -> None:
    """``out += a @ b``: in place when the dtypes allow (CPU has no mixed-dtype addmm), else
    through ``product``, a buffer of ``a @ b``'s shape and dtype that every chunk reuses."""
    if product is None:
        out.addmm_(a, b)
    else:
        out += torch.mm(a, b, out=product)


@torch.library.custom_op("compiled_logprob::lm_head_stats_backward", mutates_args=())
def lm_head_stats_backward(
    grad_log_total: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_total: torch.Tensor,
    entropy: torch.Tensor,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    chunk_size: int | None,
    needs_grad_hidden: bool,
    needs_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_shape, weight_shape = _grad_shapes(hidden, weight, needs_grad_hidden, needs_grad_weight)
    grad_hidden = hidden.new_empty(hidden_shape)
    grad_weight = weight.new_zeros(weight_shape, dtype=torch.float32)  # summed over chunks
    mixed = needs_grad_weight and weight.dtype != torch.float32
    product = weight.new_empty(weight.shape) if mixed else None
    chunks = _chunks(hidden, weight, chunk_size, spare=grad_entropy is not None)
    for rows, tile, workspace, spare in chunks:
        grad = _math.grad_logits(
            grad_log_total[:, rows],
            grad_target_logit[:, rows],
            _logits(hidden[:, rows], weight, tile),
            target[:, rows],
            shift[:, rows],
            log_total[:, rows],
            vocab_start,
            ignore_index,
            temperature=_math.block_rows(temperature, rows),
            grad_entropy=_math.block_rows(grad_entropy, rows),
            entropy=entropy[:, rows],
            eager=True,
            workspace=workspace,
            spare=spare,
        )
        if grad.dtype != hidden.dtype:
            grad = tile.copy_(grad)  # rounded once, into the tile: its logits are spent
        if needs_grad_hidden:
            grad_hidden[:, rows] = grad @ weight
        if needs_grad_weight:
            _add_matmul(grad_weight, grad.flatten(0, 1).T, hidden[:, rows].flatten(0, 1), product)
    if needs_grad_hidden and group_name is not None:
        grad_hidden = funcol.wait_tensor(funcol.all_reduce(grad_hidden, "sum", group_name))
    return grad_hidden, grad_weight.to(weight.dtype)


def _grad_shapes(hidden, weight, needs_grad_hidden, needs_grad_weight):
    """The shapes of ``(grad_hidden, grad_weight)``: the inputs', or ``[0]`` where not needed."""
    return (
        hidden.shape if needs_grad_hidden else (0,),
        weight.shape if needs_grad_weight else (0,),
    )


@lm_head_stats_backward.register_fake
def _(grad_log_total, grad_target_logit, grad_entropy, hidden, weight, *rest, **options):
    hidden_shape, weight_shape = _grad_shapes(
        hidden, weight, options["needs_grad_hidden"], options["needs_grad_weight"]
    )
    return hidden.new_empty(hidden_shape), weight.new_empty(weight_shape)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, target, temperature = inputs
    shift, log_total, _, entropy, topk_ids = output
    ctx.mark_non_differentiable(shift)  # as in _ops: the other outputs are invariant to it
    if keyword_only_inputs["topk"]:
        target = topk_ids
    ctx.save_for_backward(hidden, weight, target, temperature, shift, log_total, entropy)
    ctx.options = {
        name: keyword_only_inputs[name]
        for name in ("vocab_start", "group_name", "ignore_index", "chunk_size")
    }
    ctx.with_entropy = keyword_only_inputs["with_entropy"]


def _backward(ctx, _, grad_log_total, grad_target_logit, grad_entropy, __):
    hidden, weight, target, temperature, shift, log_total, entropy = ctx.saved_tensors
    needs_grad_hidden, needs_grad_weight, _, _ = ctx.needs_input_grad
    grad_hidden, grad_weight = lm_head_stats_backward(
        grad_log_total,
        grad_target_logit,
        grad_entropy if ctx.with_entropy else None,
        hidden,
        weight,
        target,
        temperature,
        shift,
        log_total,
        entropy,
        **ctx.options,
        needs_grad_hidden=needs_grad_hidden,
        needs_grad_weight=needs_grad_weight,
    )
    return (
        grad_hidden if needs_grad_hidden else None,
        grad_weight if needs_grad_weight else None,
        None,
        None,
    )


lm_head_stats.register_autograd(_backward, setup_context=_setup_context)
