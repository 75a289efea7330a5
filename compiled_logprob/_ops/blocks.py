"""How the eager kernels cut the sequence into blocks, and the block buffers they reuse.

Blocks are of at least :func:`min_block_elements` elements (or one row), enough to amortise
per-op overhead, and at most ``BLOCKS_PER_CALL`` per call and per block-sized temporary, so
that large logits do not pay thousands of per-op thread wake-ups (docs/design.md, "Eager
kernels").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCKS_PER_CALL = 256
MIN_BLOCK_ELEMENTS = 1 << 18
# On a GPU an op over a small block ends before the host has launched the next one.
MIN_BLOCK_ELEMENTS_GPU = 1 << 24
# The eager filtering kernels select from whole rows, at least this many at a time.
MIN_FILTER_ROWS = 8


def min_block_elements(device: torch.device) -> int:
    """Elements per eager block, at least, on ``device``."""
    return MIN_BLOCK_ELEMENTS if device.type == "cpu" else MIN_BLOCK_ELEMENTS_GPU


class Block(NamedTuple):
    """One eager block: its sequence positions and its views of the reused fp32 buffers."""

    rows: slice
    workspace: torch.Tensor | None
    spare: torch.Tensor | None


def seq_blocks(
    logits: torch.Tensor, chunk_size: int | None, *, workspace: bool = True, spare: bool = False
) -> list[Block]:
    """The blocks of sequence positions of ``logits`` ``[B, S, V_local]`` (at most
    ``chunk_size`` each), each with views of an fp32 ``workspace`` and, for a second
    block-sized temporary, a ``spare`` one, when asked for: every block reuses them."""
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
        blocks.append(Block(
            slice(start, start + block),
            next(views) if workspace else None,
            next(views) if spare else None,
        ))
    return blocks
