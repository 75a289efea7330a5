"""Context-parallel position maps: which position of the full row each CP rank holds.

With ``C`` CP ranks a sequence (padded to a multiple of ``2C``) is cut into ``2C`` equal
chunks and rank ``r`` holds chunks ``r`` and ``2C-1-r``: under causal attention every rank
then has the same work. Every layout is a map ``positions[r, q]`` from (rank, local
position) to a position in the full row, built on the device by index arithmetic (no host
data, so nothing syncs and nothing specialises on sequence lengths).
"""

from __future__ import annotations

import torch

from compiled_logprob import _comm


def load_balanced_positions(local, seq_start, seq_len, rank, size):
    """Position in the full row of local position ``local`` of CP rank ``rank``, for the
    sequence ``[seq_start, seq_start + seq_len)`` of the full row (all broadcastable)."""
    chunk = seq_len // (2 * size)
    offset = local - seq_start // size
    # The first `chunk` local slots hold chunk `rank`, the next ones chunk `2 * size - 1 - rank`.
    skip = torch.where(offset < chunk, rank, 2 * size - 2 - rank) * chunk
    return seq_start + offset + skip


def positions(local_len: int, size: int, device: torch.device) -> torch.Tensor:
    """``[C, L]``: the load-balanced layout of one sequence of ``C * L`` positions."""
    local = torch.arange(local_len, device=device)
    ranks = torch.arange(size, device=device).unsqueeze(-1)
    return load_balanced_positions(local, 0, size * local_len, ranks, size)


def shard(tensor: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    """CP rank ``rank``'s load-balanced shard of ``tensor`` along ``dim`` (normalised, and
    its length a multiple of ``2 * size``)."""
    full_len = tensor.shape[dim]
    local = torch.arange(full_len // size, device=tensor.device)
    return tensor.index_select(dim, load_balanced_positions(local, 0, full_len, rank, size))


def gather_to_positions(
    tensor: torch.Tensor, positions: torch.Tensor, group_name: str | None, dim: int
) -> torch.Tensor:
    """Every rank's ``tensor`` gathered along ``dim``, rank r's element q put at
    ``positions[r, q]`` (``group_name=None``: this rank's ``tensor`` is all there is).

    Backward: ``index_select``'s (an ``index_add``), then the all-gather's own, one
    reduce-scatter: each rank receives the sum over CP ranks of the gradients at its
    positions."""
    gathered = tensor.movedim(dim, 0)
    if group_name is not None:
        gathered = _comm.all_gather(gathered, group_name)
    # ``positions`` is a permutation: read through its inverse (docs/design.md, "Context parallelism").
    placed = gathered.index_select(0, torch.argsort(positions.flatten()))
    return placed.movedim(0, dim)
