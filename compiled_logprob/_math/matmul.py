"""The LM head's matmuls: each row the same bits whatever the number of rows, and fp32
products of bf16/fp16 operands where the caller asks for fp32 logits.

Shape legend: ``n`` rows (positions of a tile), ``k`` the contracted dimension, ``m``
columns.
"""

from __future__ import annotations

import torch

# Rows below which MKL's matmul takes kernels that sum in another order (row_invariant_mm).
MIN_GEMM_ROWS = 16


def row_invariant_mm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` (into ``out`` when given), each row the same bits whatever the number of
    rows of ``a``: MKL multiplies fewer than :data:`MIN_GEMM_ROWS` rows with other kernels,
    whose sums run in another order, so fewer rows are padded with zeros (docs/design.md,
    "Batch invariance")."""
    rows = a.shape[0]
    if rows == 0 or rows >= MIN_GEMM_ROWS:
        return torch.mm(a, b, out=out)
    padded = a.new_zeros(MIN_GEMM_ROWS, a.shape[1])
    padded[:rows] = a
    product = torch.mm(padded, b)[:rows]
    return product if out is None else out.copy_(product)


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a`` ``[n, k]`` @ ``b`` ``[k, m]`` with :func:`row_invariant_mm`'s rows, in ``dtype``
    (``out``'s, else ``a``'s): an operand in a narrower dtype is upcast first, so that the
    product accumulates and rounds in ``dtype`` (a bf16 matmul accumulates in fp32 but
    rounds its output, and the CPU has no mixed-dtype matmul). Callers upcast a weight
    once per call, not per tile."""
    dtype = out.dtype if out is not None else (dtype or a.dtype)
    return row_invariant_mm(a.to(dtype), b.to(dtype), out)


def add_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, product: torch.Tensor | None) -> None:
    """``out += a @ b`` in ``out``'s dtype, for a weight's gradient summed over tiles: ``a``
    (the logits' gradient, transposed) in ``out``'s dtype takes ``b`` (a tile's hidden
    states, small) upcast; otherwise the product of ``a`` and ``b`` in their dtype goes
    through ``product``, a buffer of its shape that every tile reuses (CPU has no
    mixed-dtype addmm)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b.to(out.dtype))
    else:
        out += torch.mm(a, b, out=product)
