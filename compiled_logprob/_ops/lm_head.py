"""``compiled_logprob::lm_head_stats`` and its backward: token log-probs straight from hidden
states, the logits never materialised.

* ``lm_head_stats(hidden, weight, target, temperature, *, vocab_start, group_name,
  ignore_index, chunk_size, with_entropy, topk, sequence_parallel, logits_dtype) -> Stats``:
  per tile (a chunk of positions and a block of the vocabulary, :func:`tiles`), the logits
  ``z = hidden @ weight.T / temperature`` (the product in ``logits_dtype``; ``temperature``
  fp32 ``[B, S]``, or ``None`` for 1), their per-row statistics and the logits of the
  targets ``[B, S, K]`` or, with ``topk`` > 0 (and no target), of this shard's top
  ``topk``; one all-gather of the ``[B, S, F]`` statistics of the whole call over the TP
  group. The outputs are the logits op's (``_math.merge.Stats``).
* ``lm_head_stats_backward``: recomputes each tile, forms its gradient with
  ``_math.grad.grad_logits`` and accumulates ``grad_hidden`` (over a chunk's blocks, in
  fp32) and ``grad_weight`` (each block its own rows, summed over chunks in fp32);
  ``grad_hidden`` is then all-reduced over the TP group, because every rank's part covers
  only its vocabulary slice of the replicated hidden states (with ``sequence_parallel`` it
  is not: the hidden states are a differentiable all-gather of sequence shards, whose
  backward reduce-scatters the parts instead). With a ``threshold`` (``lm_head_filtered``),
  of the filtered softmax. Only the gradients that autograd asks for are formed (the other
  is an empty tensor): a frozen LM head costs no fp32 ``[V_local, H]`` buffer and no second
  matmul per tile.

Both stay opaque to the compiler (no decomposition), so their loops over tiles never unroll
into the graph and no ``[B, S, V_local]`` tensor exists anywhere: temporaries are a few
tiles of fp32.

Shape legend: ``B`` batch, ``S`` sequence, ``H`` hidden size, ``V_local`` this rank's
vocabulary slice, ``R`` ranks of the vocab-parallel group, ``F`` statistics per row.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from compiled_logprob import _comm
from compiled_logprob._math import grad as _grad
from compiled_logprob._math import matmul, merge, stats
from compiled_logprob._math import tiles as _tiles
from compiled_logprob._math import topk as _topk
from compiled_logprob._math.kernels import Eager, block_rows
from compiled_logprob._math.merge import Stats

# Default tile: about this many elements (64 MiB in fp32), so that a handful of tile-sized
# temporaries stay far below the logits path's peak.
TILE_ELEMENTS = 1 << 24


class Tile(NamedTuple):
    """One chunk of positions and one block of this shard's vocabulary, with its views of
    the buffers that every tile reuses."""

    rows: slice
    cols: slice  # of the shard's ids, starting at a multiple of tiles.TILE_WIDTH
    logits: torch.Tensor  # [B, c, w], logits_dtype
    workspace: torch.Tensor | None  # [B, c, w] fp32
    spare: torch.Tensor | None  # [B, c, w] fp32, for a second temporary


def tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int | None,
    *,
    spare: bool,
    logits_dtype: torch.dtype,
    workspace: bool = True,
    whole_rows: bool = True,
    min_block: int = 1,
) -> list[Tile]:
    """The tiles of ``hidden @ weight.T``, chunks of positions (row-major) each with its
    ``[B, c, w]`` views of buffers that every tile reuses: the logits tile
    (``logits_dtype``), an fp32 ``workspace`` and an fp32 ``spare`` (the entropy's second
    temporary) when asked for. Fresh tile-sized temporaries would fault their pages in for
    every tile.

    ``whole_rows``: each tile spans the shard's vocabulary (filtering needs whole rows).
    Otherwise a chunk holds all positions (up to ``chunk_size``) and is cut into blocks of
    whole ``TILE_WIDTH`` tiles: a matmul of many rows against a block of the weight runs at
    full speed, where a few rows against all of it stream the whole weight for each chunk
    (docs/design.md, "Tiles of the LM head"). A last block narrower than ``min_block`` ids
    joins the one before it (a block's top k needs k ids)."""
    batch, seq_len, _ = hidden.shape
    vocab = weight.shape[0]
    if whole_rows:
        chunk_size = chunk_size or max(1, TILE_ELEMENTS // max(1, batch * vocab))
        width = vocab
    else:
        chunk_size = chunk_size or max(1, TILE_ELEMENTS // max(1, batch * _tiles.TILE_WIDTH))
        rows = batch * min(chunk_size, max(seq_len, 1))
        width = TILE_ELEMENTS // max(1, rows) // _tiles.TILE_WIDTH * _tiles.TILE_WIDTH
        width = min(vocab, max(_tiles.TILE_WIDTH, width))
    starts = list(range(0, max(vocab, 1), max(width, 1)))
    if len(starts) > 1 and vocab - starts[-1] < min_block:
        starts.pop()
    ends = [*starts[1:], vocab]
    widest = max(end - start for start, end in zip(starts, ends))
    tile_elements = batch * min(chunk_size, max(seq_len, 1)) * widest
    logits = hidden.new_empty(tile_elements, dtype=logits_dtype)
    fp32 = hidden.new_empty((workspace + spare) * tile_elements, dtype=torch.float32)

    def view(buffer: torch.Tensor, positions: int, ids: int, index: int = 0) -> torch.Tensor:
        start = index * tile_elements
        return buffer[start : start + batch * positions * ids].view(batch, positions, ids)

    chunks = []
    # At least one (possibly empty) tile: an empty sequence still joins the collective.
    for start in range(0, max(seq_len, 1), chunk_size):
        n = max(0, min(chunk_size, seq_len - start))
        for first, end in zip(starts, ends):
            ids = end - first
            chunks.append(Tile(
                slice(start, start + chunk_size),
                slice(first, first + ids),
                view(logits, n, ids),
                view(fp32, n, ids) if workspace else None,
                view(fp32, n, ids, int(workspace)) if spare else None,
            ))
    return chunks


def by_chunk(chunks: list[Tile]) -> list[list[Tile]]:
    """:func:`tiles` grouped by chunk of positions, each chunk's blocks in order."""
    return [list(group) for _, group in itertools.groupby(chunks, key=lambda tile: tile.rows.start)]


def logits_tile(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``[B, c, V_local]`` tile ``hidden @ weight.T`` in ``out``'s dtype (written into
    ``out``): the inputs' dtype, as the logits path computes its logits, or fp32 (an fp32
    LM head's logits from bf16 operands); the temperature and everything after it run in
    fp32 in ``_math``. One 2-D matmul: ``torch.matmul`` with ``out=`` takes a batched path
    with copies for a sliced ``hidden``."""
    matmul.mm(hidden.flatten(0, 1), weight.T, out.view(-1, weight.shape[0]))
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
    sequence_parallel: bool,
    logits_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (target is None) == (topk > 0), "the top-k are the targets"
    weight = weight.to(logits_dtype)  # upcast once for every tile, when the logits are wider
    chunks = tiles(
        hidden, weight, chunk_size, spare=with_entropy, logits_dtype=logits_dtype,
        whole_rows=False, min_block=topk,
    )
    rows, per_tile = [], []
    for chunk in by_chunk(chunks):
        blocks, best = [], None
        for tile in chunk:
            logits = logits_tile(hidden[:, tile.rows], weight[tile.cols], tile.logits)
            local = stats.local_stats(
                logits,
                block_rows(target, tile.rows),
                vocab_start + tile.cols.start,
                temperature=block_rows(temperature, tile.rows),
                with_entropy=with_entropy,
                ops=Eager(tile.workspace, tile.spare),
            )
            if topk:  # the best k so far: two blocks' candidates at a time, not every block's
                found = _topk.topk_stats(logits, topk, vocab_start + tile.cols.start)
                best = found if best is None else _topk.join_candidates(best, found, topk)
            blocks.append(local)
        joined = stats.join_columns(blocks)
        if best is not None:
            joined = stats.LocalStats(torch.cat([joined.rows, best], dim=-1), joined.tiles)
        rows.append(joined.rows)
        per_tile.append(joined.tiles)
    result = merge.exchange_stats(
        stats.LocalStats(torch.cat(rows, dim=1), torch.cat(per_tile, dim=1)),
        target,
        group_name,
        ignore_index,
        temperature=temperature,
        with_entropy=with_entropy,
        topk=topk,
    )
    return (*result,)  # the schema's plain tuple, not the NamedTuple


@lm_head_stats.register_fake
def _(hidden, weight, target, temperature, *, topk, **options):
    return tuple(merge.empty_stats(hidden, target, topk))


@torch.library.custom_op("compiled_logprob::lm_head_stats_backward", mutates_args=())
def lm_head_stats_backward(
    grad_log_norm: torch.Tensor,
    grad_target_logit: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor | None,
    threshold: torch.Tensor | None,
    *,
    vocab_start: int,
    group_name: str | None,
    ignore_index: int | None,
    chunk_size: int | None,
    sequence_parallel: bool,
    logits_dtype: torch.dtype,
    needs_grad_hidden: bool,
    needs_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grads = _grad.RowGrads(grad_log_norm, grad_target_logit, grad_entropy)
    saved = _grad.RowStats(shift, log_norm, temperature, entropy, threshold)
    head = HeadGrads(hidden, weight, logits_dtype, needs_grad_hidden, needs_grad_weight)
    weight = head.weight  # in the logits' dtype
    # Every entry's gradient needs only its row's saved statistics: blocks of the vocabulary.
    chunks = tiles(
        hidden, weight, chunk_size, spare=grad_entropy is not None, logits_dtype=logits_dtype,
        whole_rows=False,
    )
    for tile in chunks:
        rows = tile.rows
        grad = _grad.grad_logits(
            grads.block(rows),
            saved.block(rows),
            logits_tile(hidden[:, rows], weight[tile.cols], tile.logits),
            target[:, rows],
            vocab_start + tile.cols.start,
            ignore_index,
            ops=Eager(tile.workspace, tile.spare),
        )
        if grad.dtype != logits_dtype:
            grad = tile.logits.copy_(grad)  # rounded once, into the tile: its logits are spent
        head.accumulate(grad, tile)
    return head.results(group_name, sequence_parallel)


class HeadGrads:
    """One LM head's gradient buffers, only those asked for (the others ``[0]``): its
    hidden states' (each chunk's summed over its blocks in fp32) and its weight's (each
    block its own rows, summed over chunks in fp32)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        logits_dtype: torch.dtype,
        needs_hidden: bool,
        needs_weight: bool,
    ):
        # The weight in the logits' dtype for the products; its gradient in its own.
        self.hidden, self.weight, self.weight_dtype = hidden, weight.to(logits_dtype), weight.dtype
        self.needs_hidden, self.needs_weight = needs_hidden, needs_weight
        self.needed = needs_hidden or needs_weight
        hidden_shape, weight_shape = _grad_shapes(hidden, weight, needs_hidden, needs_weight)
        self.grad_hidden = hidden.new_empty(hidden_shape)
        self.grad_weight = weight.new_zeros(weight_shape, dtype=torch.float32)
        # The gradient is rounded to the logits' dtype; a product in it goes through a buffer.
        mixed = needs_weight and logits_dtype != torch.float32
        self.product = weight.new_empty(weight.shape, dtype=logits_dtype) if mixed else None
        # The current chunk's hidden-state gradient, while its blocks are summed.
        self.hidden_sum = hidden.new_empty(0, dtype=torch.float32)

    def accumulate(self, gradient: torch.Tensor, tile: Tile) -> None:
        """Adds ``tile``'s logits gradient ``[B, c, w]``: tiles come row-major, each chunk's
        vocabulary blocks in order."""
        flat, rows, cols = gradient.flatten(0, 1), tile.rows, tile.cols
        if self.needs_hidden:
            part = matmul.mm(flat, self.weight[cols]).unflatten(0, gradient.shape[:2])
            first, last = cols.start == 0, cols.stop >= self.weight.shape[0]
            if first and last:
                self.grad_hidden[:, rows] = part
            else:  # summed over the chunk's blocks in fp32, then rounded once
                if first:
                    self.hidden_sum = part.float()
                else:
                    self.hidden_sum += part
                if last:
                    self.grad_hidden[:, rows] = self.hidden_sum
        if self.needs_weight:
            product = None if self.product is None else self.product[cols]
            hidden = self.hidden[:, rows].flatten(0, 1)
            matmul.add_mm(self.grad_weight[cols], flat.T, hidden, product)

    def results(self, group_name: str | None, sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_hidden, grad_weight)``: the hidden states' all-reduced over the TP group,
        each rank's part covering only its vocabulary slice of the replicated hidden states
        (with ``sequence_parallel`` not: the all-gather's backward sums the parts)."""
        grad_hidden = self.grad_hidden
        if self.needs_hidden and not sequence_parallel:
            grad_hidden = _comm.all_reduce_sum(grad_hidden, group_name)
        return grad_hidden, self.grad_weight.to(self.weight_dtype)


def _grad_shapes(hidden, weight, needs_grad_hidden, needs_grad_weight):
    """The shapes of ``(grad_hidden, grad_weight)``: the inputs', or ``[0]`` where not needed."""
    return (
        hidden.shape if needs_grad_hidden else (0,),
        weight.shape if needs_grad_weight else (0,),
    )


@lm_head_stats_backward.register_fake
def _(grad_log_norm, grad_target_logit, grad_entropy, hidden, weight, *rest, **options):
    hidden_shape, weight_shape = _grad_shapes(
        hidden, weight, options["needs_grad_hidden"], options["needs_grad_weight"]
    )
    return hidden.new_empty(hidden_shape), weight.new_empty(weight_shape)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, target, temperature = inputs
    result = Stats(*output)
    # As the logits op: the other outputs are invariant to the shift.
    ctx.mark_non_differentiable(result.shift, result.verdict)
    if keyword_only_inputs["topk"]:
        target = result.topk_ids
    ctx.save_for_backward(
        hidden, weight, target, temperature, result.shift, result.log_norm, result.entropy
    )
    ctx.options = backward_options(keyword_only_inputs)
    ctx.with_entropy = keyword_only_inputs["with_entropy"]


def backward_options(keyword_only_inputs: dict) -> dict:
    """The options of :func:`lm_head_stats_backward` among a forward op's."""
    names = ("vocab_start", "group_name", "ignore_index", "chunk_size", "sequence_parallel", "logits_dtype")
    return {name: keyword_only_inputs[name] for name in names}


def _backward(ctx, _, grad_log_norm, grad_target_logit, grad_entropy, __, ___):
    hidden, weight, target, temperature, shift, log_norm, entropy = ctx.saved_tensors
    grads = _grad.RowGrads(grad_log_norm, grad_target_logit, grad_entropy if ctx.with_entropy else None)
    saved = _grad.RowStats(shift, log_norm, temperature, entropy)
    return input_grads(ctx, grads, saved, hidden, weight, target)


def input_grads(
    ctx,
    grads: _grad.RowGrads,
    saved: _grad.RowStats,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
    """An LM-head op's autograd result for its inputs ``(hidden, weight, target,
    temperature)``: :func:`lm_head_stats_backward` of only the gradients asked for."""
    needs_grad_hidden, needs_grad_weight, _, _ = ctx.needs_input_grad
    grad_hidden, grad_weight = lm_head_stats_backward(
        *grads,
        hidden,
        weight,
        target,
        saved.temperature,
        saved.shift,
        saved.log_norm,
        saved.entropy,
        saved.threshold,
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


def lm_head_stats_of(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor | None,
    temperature: torch.Tensor | None,
    **options,
) -> Stats:
    """:func:`lm_head_stats` with its outputs named."""
    return Stats(*lm_head_stats(hidden, weight, target, temperature, **options))
