"""The fixed reduction order that makes a row's statistics depend on its own logits only:
not on the batch, the chunking, the packing, or how the vocabulary and the sequence are
sharded (docs/design.md, "Batch invariance").

* **Within a tile**: each shard's vocabulary is cut into tiles of :data:`TILE_WIDTH` ids
  from its first id (the last tile may be narrower), and each tile is reduced on its own:
  its max, then its sums relative to that max, in an order that depends only on the tile's
  width. A shard whose first id is a multiple of :data:`TILE_WIDTH` cuts the global
  vocabulary's own tiles.
* **Across tiles and ranks**: each tile's sum is rescaled to the row's global max and
  rounded to a fixed-point integer (:func:`fixed_point`); integer sums are exact, so the
  total is the same in any order, over any grouping of tiles into shards, and one
  all-reduce of ``[B, S, *]`` integers, of one size on every rank, adds the shards'.
"""

from __future__ import annotations

import torch

# Ids per tile: a multiple of every vector width, and wide enough that the per-tile
# reduction costs nothing next to the row's (docs/performance.md, "Batch invariance").
TILE_WIDTH = 1024
# Slices of a tile that Traced CPU reductions combine first (kernels.sliced): none. A tile's
# loop is short already, and slicing a 1024-wide tile measured 1.6x the whole-row pass.
TILE_SLICES = 1
# Fixed-point fraction bits: tile sums are at most TILE_WIDTH, so a row's total stays below
# 2**63 for vocabularies up to 2**(63 - FRACTION_BITS) ids, and each tile rounds by
# 2**-(FRACTION_BITS + 1), far below an fp32 ulp of a total of at least 1.
FRACTION_BITS = 36
_SCALE = float(2**FRACTION_BITS)


def whole_width(width: int) -> int:
    """The ids of a shard of ``width`` that whole tiles cover, from its first."""
    return width // TILE_WIDTH * TILE_WIDTH


def split(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views ``[..., T, TILE_WIDTH]`` of the whole tiles of ``tensor`` ``[..., V_local]``
    and ``[..., 1, r]`` of the narrower last one, those that exist."""
    width = tensor.shape[-1]
    whole = whole_width(width)
    parts = []
    if whole:
        parts.append(tensor[..., :whole].unflatten(-1, (whole // TILE_WIDTH, TILE_WIDTH)))
    if whole < width or not parts:
        parts.append(tensor[..., whole:].unsqueeze(-2))
    return parts


def fixed_point(terms: torch.Tensor) -> torch.Tensor:
    """int64 ``Σ round(terms · 2**FRACTION_BITS)`` over the last dimension: exact, hence
    the same in any order. ``terms`` must be finite and their sum below
    ``2**(63 − FRACTION_BITS)`` in magnitude."""
    return torch.round(terms.double() * _SCALE).to(torch.int64).sum(-1)


def from_fixed_point(total: torch.Tensor) -> torch.Tensor:
    """The fp64 value of a :func:`fixed_point` total."""
    return total.double() / _SCALE
