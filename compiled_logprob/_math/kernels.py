"""The two ways a pass over the logits runs, chosen once per call: ``Traced`` for Inductor
(functional ops that it fuses into one loop) and ``Eager`` for the op-by-op kernels of the
custom ops (fresh temporaries updated in place, in reusable fp32 block buffers).

The math modules write each pass once, against this small interface: an exponent unit and
its exponential, row reductions, and the arithmetic steps of a pass, which ``Eager`` runs
in place and ``Traced`` functionally (docs/design.md, "Eager and traced passes").
"""

from __future__ import annotations

import math
from typing import Callable, overload

import torch

from compiled_logprob._torch_compat import assert_async as _assert_async

INF = float("inf")
# A floor for exponents: e^c and 2^c are 0 in fp32 below c = -150 already.
EXPONENT_FLOOR = -1024.0
# Slices of a row that Traced CPU reductions combine elementwise before reducing: Inductor's
# CPU reduction loop keeps one accumulator, and slices give it independent work.
ROW_SLICES = 8
# Two sums in one loop (the entropy's, the cross-entropy's) take half as many, which keeps
# the loop under Inductor's CPU op-count limit for inlining.
PAIR_SLICES = 4
_PROMOTE_TO_FP32 = (torch.float16, torch.bfloat16, torch.float32)

# CUDA's kernel-side assert refuses a longer message ("Message length must be smaller than
# 255"), so a check that reads well on CPU would break every call on a GPU.
DEVICE_MESSAGE_LIMIT = 254


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Checks ``condition`` on the device (no host sync); the message's length is checked on
    every device, not only where CUDA would refuse it."""
    assert len(message) <= DEVICE_MESSAGE_LIMIT, f"over {DEVICE_MESSAGE_LIMIT} characters: {message}"
    _assert_async(condition, message)


@torch.library.custom_op("compiled_logprob::pointwise", mutates_args=())
def pointwise(x: torch.Tensor, function: str) -> torch.Tensor:
    """``torch.exp(x)`` or ``torch.log(x)`` (``function``), as ATen computes it, opaque to
    the compiler: the same bits for an entry whatever the tensor's shape, eager or compiled.

    Inductor's CPU code computes exp and log with its vector functions in vectorised loops
    and with libm's in scalar ones, and which loop a row's statistics fall in depends on the
    number of rows (docs/design.md, "Batch invariance"). Per-row and per-tile functions
    take this op; passes over the vocabulary stay fused (their inner loop is always the
    vectorised one)."""
    return torch.exp(x) if function == "exp" else torch.log(x)


@pointwise.register_fake
def _(x: torch.Tensor, function: str) -> torch.Tensor:
    return torch.empty_like(x)


def exact_exp(x: torch.Tensor) -> torch.Tensor:
    """Per-row ``exp``, the same bits at any shape (:func:`pointwise`)."""
    return pointwise(x, "exp")


def exact_log(x: torch.Tensor) -> torch.Tensor:
    """Per-row ``log``, the same bits at any shape (:func:`pointwise`)."""
    return pointwise(x, "log")


def promoted(logits: torch.Tensor) -> torch.Tensor:
    """The logits as they are when every use promotes them to fp32 exactly (16- and 32-bit
    floats meet an fp32 tensor in each op), else an fp32 copy."""
    return logits if logits.dtype in _PROMOTE_TO_FP32 else logits.float()


def finite_or_zero(row_max: torch.Tensor) -> torch.Tensor:
    """``row_max`` with 0 where it is infinite: torch.logsumexp's convention, so that an all
    ``-inf`` row sums to 0 (lse ``-inf``) and a ``+inf`` logit stays ``+inf``, not NaN."""
    return torch.where(row_max.abs() == INF, 0.0, row_max)


def sliced(
    terms: torch.Tensor,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor],
    slices: int = ROW_SLICES,
) -> torch.Tensor:
    """``reduce(terms)``, a keepdim reduction over the last dimension, as Inductor's CPU code
    runs it fastest: ``combine`` merges ``slices`` contiguous slices elementwise, in a
    balanced tree, then ``reduce`` takes that and the entries left over. Other devices
    reduce in one go (Triton's reductions have no such chain)."""
    width = terms.shape[-1] // slices
    if width == 0 or not terms.is_cpu:
        return reduce(terms)
    parts = list(terms[..., : width * slices].unflatten(-1, (slices, width)).unbind(-2))
    while len(parts) > 1:
        parts = [
            combine(*parts[i : i + 2]) if i + 1 < len(parts) else parts[i]
            for i in range(0, len(parts), 2)
        ]
    reduced, rest = reduce(parts[0]), terms[..., width * slices :]
    return reduced if rest.shape[-1] == 0 else combine(reduced, reduce(rest))


def row_max(x: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
    """The traced ``x.amax(-1, keepdim=True)``, over slices on the CPU."""
    return sliced(x, torch.maximum, lambda t: t.amax(-1, keepdim=True), slices)


def row_sum(terms: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
    """The traced ``terms.sum(-1, keepdim=True)``, over slices on the CPU."""
    return sliced(terms, torch.add, lambda t: t.sum(-1, keepdim=True), slices)



class Traced:
    """Functional ops, for Inductor to fuse into one pass over the vocabulary.

    Exponents are in base 2 (``exp2``, as fast as ``exp`` in Inductor's CPU code, with the
    change of base fused into the per-row multiply); row reductions run over slices on the
    CPU. There are no buffers: every step returns a new tensor.
    """

    unit = math.log(2.0)  # nats per unit of the exponents
    workspace: torch.Tensor | None = None
    spare: torch.Tensor | None = None

    def fp32(self, block: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The block as fp32 arithmetic reads it (promoted in each op, no copy)."""
        return promoted(block)

    def row_max(self, x: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
        return row_max(x, slices)

    def row_sum(self, terms: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
        return row_sum(terms, slices)

    def xexp_sum(
        self, exponents: torch.Tensor, exps: torch.Tensor, slices: int = PAIR_SLICES
    ) -> torch.Tensor:
        """``Σ c · e^c`` per row, 0 for the terms where ``c = -inf``: a floor on ``c`` does it
        (``e^c`` is 0 there already; a nansum would split the loop)."""
        return row_sum(exponents.clamp(min=EXPONENT_FLOOR) * exps, slices)

    def per_row(self, *values: torch.Tensor | float) -> list[torch.Tensor | float]:
        """``values`` (``[B, S]`` tensors or floats) as ``[B, S, 1]`` factors of a pass. On
        the CPU the tensors are stacked into one buffer: inlined, their arithmetic would be
        recomputed for every vector of the row. Triton keeps them in registers."""
        rows = [value for value in values if isinstance(value, torch.Tensor)]
        if len(rows) > 1 and rows[0].is_cpu:
            rows = list(torch.stack(rows, dim=-1).unbind(-1))
        it = iter(rows)
        return [next(it).unsqueeze(-1) if isinstance(v, torch.Tensor) else v for v in values]

    def minus(
        self, z: torch.Tensor, rows: torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 ``z − rows`` (``rows`` ``[B, S, 1]``)."""
        return z - rows

    def scale(self, t: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
        """``t · factor``, no pass when ``factor`` is the float 1."""
        if isinstance(factor, float) and factor == 1.0:
            return t
        return t * factor

    def exp(self, t: torch.Tensor) -> torch.Tensor:
        """The exponential of exponents in :attr:`unit`'s units."""
        return torch.exp2(t)

    def exp_into(self, t: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """:meth:`exp` of ``t``, leaving ``t`` as it is."""
        return torch.exp2(t)

    def mul(self, t: torch.Tensor, other) -> torch.Tensor:
        return t * other

    def add(self, t: torch.Tensor, other) -> torch.Tensor:
        return t + other

    def sub(self, t: torch.Tensor, other) -> torch.Tensor:
        return t - other

    def neg(self, t: torch.Tensor) -> torch.Tensor:
        return -t

    def clamp_min(self, t: torch.Tensor, low: float) -> torch.Tensor:
        return t.clamp(min=low)

    def masked_fill(self, t: torch.Tensor, mask: torch.Tensor | None, value: float) -> torch.Tensor:
        return t if mask is None else t.masked_fill(mask, value)


class Eager(Traced):
    """Op-by-op kernels on one block of rows: every step updates a fresh temporary in place,
    in the fp32 block buffers ``workspace`` and ``spare`` when given (an eager call reuses
    them for all its blocks: no allocation and no page faults per block).

    Exponents are in nats: every op is a pass over the block, and without a temperature
    ``exp(x − shift)`` needs no scaling pass (ATen's ``exp`` is also faster than its
    ``exp2``). Row reductions are ATen's.
    """

    unit = 1.0

    def __init__(
        self, workspace: torch.Tensor | None = None, spare: torch.Tensor | None = None
    ) -> None:
        self.workspace, self.spare = workspace, spare

    def fp32(self, block: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """A 16-bit block converted to fp32 first (into ``into`` when given, else fresh), to
        be updated in place: ATen reduces a 16-bit inner dimension several times slower."""
        if block.dtype == torch.float32:
            return block
        return block.float() if into is None else into.copy_(block)

    def row_max(self, x: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
        return x.amax(-1, keepdim=True)

    def row_sum(self, terms: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
        return terms.sum(-1, keepdim=True)

    def xexp_sum(
        self, exponents: torch.Tensor, exps: torch.Tensor, slices: int = PAIR_SLICES
    ) -> torch.Tensor:
        """``Σ c · e^c`` per row, in place in ``exponents``: nansum drops the ``-inf · 0``
        terms at no cost (a NaN logit still gives NaN: it is the max, and every sum has it)."""
        return exponents.mul_(exps).nansum(-1, keepdim=True)

    def per_row(self, *values: torch.Tensor | float) -> list[torch.Tensor | float]:
        return [v.unsqueeze(-1) if isinstance(v, torch.Tensor) else v for v in values]

    def minus(
        self, z: torch.Tensor, rows: torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 ``z − rows``, fresh or written into ``into`` (in place when ``z`` lives there)."""
        if into is None:
            return z - rows
        if z is into:
            return z.sub_(rows)
        if z.dtype == into.dtype:
            return torch.sub(z, rows, out=into)
        # A plain conversion is several times faster than mixed-dtype arithmetic with out=.
        return into.copy_(z).sub_(rows)

    def scale(self, t: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
        if isinstance(factor, float) and factor == 1.0:
            return t
        return t.mul_(factor)

    def exp(self, t: torch.Tensor) -> torch.Tensor:
        return t.exp_()

    def exp_into(self, t: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        return torch.exp(t, out=into) if into is not None else torch.exp(t)

    def mul(self, t: torch.Tensor, other) -> torch.Tensor:
        return t.mul_(other)

    def add(self, t: torch.Tensor, other) -> torch.Tensor:
        return t.add_(other)

    def sub(self, t: torch.Tensor, other) -> torch.Tensor:
        return t.sub_(other)

    def neg(self, t: torch.Tensor) -> torch.Tensor:
        return t.neg_()

    def clamp_min(self, t: torch.Tensor, low: float) -> torch.Tensor:
        return t.clamp_(min=low)

    def masked_fill(self, t: torch.Tensor, mask: torch.Tensor | None, value: float) -> torch.Tensor:
        return t if mask is None else t.masked_fill_(mask, value)


# The interface that both implement: math functions take ``ops: Kernels``.
Kernels = Traced


def exponent_scale(temperature: torch.Tensor | None, ops: Traced) -> float | torch.Tensor:
    """``1 / (unit · temperature)`` ``[B, S]`` (a float without a temperature): the one
    multiply that takes ``x − shift`` to exponents of ``z = x / temperature`` in ``ops``'
    units. A positive temperature is monotone, so ``max(z) = max(x) / temperature``
    exactly and the logits are never divided element by element."""
    return 1.0 / ops.unit if temperature is None else (1.0 / ops.unit) / temperature


@overload
def block_rows(tensor: torch.Tensor, rows: slice) -> torch.Tensor: ...
@overload
def block_rows(tensor: None, rows: slice) -> None: ...
@overload
def block_rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None: ...
def block_rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The positions ``rows`` of a per-position ``[B, S, *]`` tensor (``None`` stays
    ``None``): an eager block's part."""
    return None if tensor is None else tensor[:, rows]
