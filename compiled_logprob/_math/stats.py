"""One shard's statistics: a single pass over its logits, before anything crosses ranks.

A shard's statistics are raw sums, so that one loop over the logits produces them all and
the logs and divisions wait until after the exchange (``merge``). They come in two parts
(:class:`LocalStats`): per row, fp32 ``[B, S, F]``, ``[max x, x_target × K, owned × K]``
(or, with a top-k, ``topk``'s candidates in place of the target's part); and per tile of
the vocabulary (``tiles``: the fixed reduction order), fp32 ``[B, S, T, P]``,
``[max x, Σ exp(u), Σ u · exp(u) (with entropy)]`` with ``u = (x − max x) / T`` over the
tile. Maxima and logits travel unscaled (``x``, not ``z``): after the exchange
``(x − shift) / T`` is exact up to one rounding, so log-probs keep their precision however
large the logits are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob._math import tiles
from compiled_logprob._math.kernels import (
    Eager,
    Kernels,
    Traced,
    exponent_scale,
    finite_or_zero,
)


class LocalStats(NamedTuple):
    """One shard's statistics, before the exchange."""

    rows: torch.Tensor  # [B, S, F] fp32: [max x, x_target × K, owned × K]
    tiles: torch.Tensor  # [B, S, T, P] fp32: [max x, Σ exp(u)(, Σ u · exp(u))] per tile


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    ops: Kernels = Traced(),
) -> LocalStats:
    """This shard's :class:`LocalStats` of ``logits`` ``[B, S, V_local]``, with the
    ``[x_target × K, owned × K]`` part of ``target`` ``[B, S, K]`` global vocabulary ids
    (none without). Eager, in place in ``ops.workspace`` (and ``ops.spare`` with entropy)
    when given."""
    return with_rows(
        tile_stats(logits, temperature=temperature, with_entropy=with_entropy, ops=ops),
        None if target is None else target_stats(logits, target, vocab_start),
    )


def with_rows(per_tile: torch.Tensor, targets: torch.Tensor | None) -> LocalStats:
    """:class:`LocalStats` of a shard's tiles ``[B, S, T, P]`` and its
    :func:`target_stats` (``None`` without targets)."""
    rows = [per_tile[..., 0].amax(-1, keepdim=True)]
    return LocalStats(torch.cat(rows if targets is None else [*rows, targets], dim=-1), per_tile)


def join_columns(blocks: list[LocalStats]) -> LocalStats:
    """The :class:`LocalStats` of a shard from those of its blocks of ids, in order, each
    starting at a multiple of ``tiles.TILE_WIDTH`` from the shard's first id: the whole
    shard's, bit for bit (its tiles are the blocks' tiles; each target's logit and
    ownership come from the one block that owns it, the others adding zeros)."""
    if len(blocks) == 1:
        return blocks[0]
    rows = torch.stack([block.rows for block in blocks])
    joined = torch.cat([rows[..., :1].amax(0), rows[..., 1:].sum(0)], dim=-1)
    return LocalStats(joined, torch.cat([block.tiles for block in blocks], dim=-2))


def tile_stats(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    with_entropy: bool,
    ops: Kernels = Traced(),
) -> torch.Tensor:
    """The tiles' part of :class:`LocalStats`, ``[B, S, T, P]``, of ``logits``
    ``[B, S, V_local]`` cut by :func:`tiles.split`."""
    parts = tiles.split(logits)
    return torch.cat(
        [
            torch.cat(
                shifted_stats(
                    part, temperature=temperature, with_entropy=with_entropy, ops=part_ops
                ),
                dim=-1,
            )
            for part, part_ops in zip(parts, _tile_ops(ops, len(parts)), strict=True)
        ],
        dim=-2,
    )


def _tile_ops(ops: Kernels, parts: int) -> list[Kernels]:
    """``ops`` for each of the ``parts`` of :func:`tiles.split`: eager, with the same views
    of its block buffers."""
    if not isinstance(ops, Eager) or ops.workspace is None:
        return [ops] * parts
    spares = [None] * parts if ops.spare is None else tiles.split(ops.spare)
    return [Eager(w, s) for w, s in zip(tiles.split(ops.workspace), spares, strict=True)]


def shifted_stats(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    with_entropy: bool,
    ops: Kernels = Traced(),
) -> list[torch.Tensor]:
    """``[x_max, Σ exp(u)(, Σ u · exp(u))]`` per tile, ``[B, S, T, 1]`` parts of tiles
    ``logits`` ``[B, S, T, W]``, ``u = (x − x_max) / T``, shifted by a finite max and
    exponentiated in ``ops``' units; ``Σ u · exp(u)`` in nats. Eager, in place in
    ``ops.workspace`` (and ``ops.spare`` with entropy) when given, in the tiles' shape."""
    workspace = ops.workspace
    x = ops.fp32(logits, workspace)
    if x is not logits and x.dtype != logits.dtype:
        workspace = x  # a fresh fp32 copy: shift it in place
    x_max = ops.row_max(x, tiles.TILE_SLICES).float()
    (scale,) = ops.per_row(exponent_scale(temperature, ops))
    if isinstance(scale, torch.Tensor):
        scale = scale.unsqueeze(-1)  # [B, S, 1, 1]: one factor for all of a row's tiles
    exponents = ops.scale(ops.minus(x, finite_or_zero(x_max), workspace), scale)
    if not with_entropy:
        return [x_max, ops.row_sum(ops.exp(exponents), tiles.TILE_SLICES)]
    exps = ops.exp_into(exponents, ops.spare)
    total = ops.row_sum(exps, tiles.TILE_SLICES)
    # e^c · c is NaN where c = -inf (vocabulary padding), for a term that is 0.
    weighted = ops.xexp_sum(exponents, exps, tiles.TILE_SLICES)
    return [x_max, total, weighted * ops.unit]


def target_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The ``[x_target × K, owned × K]`` part of :func:`local_stats`, fp32 ``[B, S, 2K]``:
    ``x_target`` is the logit at each target where this shard owns it (0 elsewhere) and
    ``owned`` is 1.0 there. A gather of K entries per row, which eager kernels do once for
    all rows rather than block by block."""
    index, owned = local_ids(target, vocab_start, logits.shape[-1])
    picked = logits.gather(-1, index).float()
    return torch.cat([torch.where(owned, picked, 0.0), owned.float()], dim=-1)


def local_ids(
    target: torch.Tensor, vocab_start: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, owned)`` of global ids ``target``: their index in this shard of ``vocab``
    entries (0 where it does not own them, a safe index to gather or scatter at) and
    whether it owns them."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0), owned
