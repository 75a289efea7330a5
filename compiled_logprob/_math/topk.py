"""A shard's top-k by block maxima, and the global top-k merged from every rank's.

Each rank finds its local top ``k`` in the statistics pass (the block maxima that select
them also give the row max); the one all-gather of statistics carries the candidates, and
the global top ``k`` are picked after it.
"""

from __future__ import annotations

import torch

# Entries per block of the block maxima (docs/design.md, "Top-k selection").
TOPK_BLOCK = 16


def topk_stats(logits: torch.Tensor, k: int, vocab_start: int) -> torch.Tensor:
    """This shard's top ``k`` as statistics, fp32 ``[B, S, 2k]``
    ``[candidate x × k, candidate global id × k]``. Ids travel as fp32 beside the values:
    exact below 2**24."""
    values, ids, _ = local_topk(logits, k)
    return torch.cat([values.float(), (ids + vocab_start).float()], dim=-1)


def local_topk(
    logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits.topk(k)`` (values, local ids) of ``[..., V_local]`` via block maxima, and the
    row max ``[..., 1]``.

    The top k entries of a row lie in its k blocks with the largest maxima (any entry of
    another block is below k distinct block maxima), or in the tail that fills no block.
    So one max-reduction pass and a top-k over the k best blocks' ``k · TOPK_BLOCK``
    entries replace a selection over the whole vocabulary. Ties may pick other ids of equal
    value.
    """
    vocab = logits.shape[-1]
    blocks = vocab // TOPK_BLOCK
    if 4 * k * TOPK_BLOCK > vocab:
        values, ids = logits.topk(k, dim=-1)
        return values, ids, logits.amax(-1, keepdim=True)
    full = blocks * TOPK_BLOCK
    # Block j holds entries j, j + blocks, ...: the maxima then reduce an outer dimension,
    # elementwise across blocks, where contiguous blocks would need a horizontal reduction.
    maxima = logits[..., :full].unflatten(-1, (TOPK_BLOCK, blocks)).amax(-2)
    row_max = maxima.amax(-1, keepdim=True)
    if full < vocab:
        row_max = torch.maximum(row_max, logits[..., full:].amax(-1, keepdim=True))
    best = maxima.topk(k, dim=-1).indices.unsqueeze(-1)
    offsets = torch.arange(TOPK_BLOCK, device=logits.device) * blocks
    candidates = (best + offsets).flatten(-2)  # [B, S, k · TOPK_BLOCK]
    tail = torch.arange(full, vocab, device=logits.device).expand(*logits.shape[:-1], -1)
    candidates = torch.cat([candidates, tail], dim=-1)
    values, picked = logits.gather(-1, candidates).topk(k, dim=-1)
    return values, candidates.gather(-1, picked), row_max


def join_candidates(first: torch.Tensor, second: torch.Tensor, k: int) -> torch.Tensor:
    """The :func:`topk_stats` of two blocks of ids together (each of at least ``k`` ids)
    from theirs: the best ``k`` of both blocks' top ``k`` (ties may pick other ids)."""
    values, ids = merge_topk(torch.stack([first, second]), k)
    return torch.cat([values, ids.float()], dim=-1)


def merge_topk(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top ``k`` ``(logits [B, S, k], int64 ids [B, S, k])``, in decreasing order,
    of every rank's :func:`topk_stats` candidates ``[R, B, S, 2k]``."""
    # [B, S, R · k]: every rank's candidates, of which the best k are global.
    candidates, ids = gathered.movedim(0, -2).split(k, dim=-1)
    candidates, ids = candidates.flatten(-2), ids.flatten(-2)
    if gathered.shape[0] > 1:
        best = candidates.topk(k, dim=-1).indices
        candidates, ids = candidates.gather(-1, best), ids.gather(-1, best)
    return candidates, ids.long()
