"""DTensor entry points: next-token log-probs of ``torch.distributed.tensor`` logits.

The logits are a DTensor sharded on the vocabulary (their last dim) over the mesh axis
``"tp"``; this rank's vocabulary bounds come from that real sharding (``torch.chunk``
semantics, so ``V = 97`` over 2 ranks gives 49 + 48), not from ``V // tp``. Under context
parallelism the token ids are a DTensor sharded on the sequence over the mesh axis
``"cp"``, holding the sequence permuted by ``seq_index`` (the layout of
``torch.distributed.tensor.experimental.context_parallel``).

Shape legend: ``B`` batch, ``S`` full sequence, ``C`` CP ranks, ``V_local`` this rank's
vocabulary slice.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from compiled_logprob import _agreement, _validation, context_parallel
from compiled_logprob._math import layout

__all__ = ["dtensor_logprobs", "vocab_shard_bounds"]


def _axis_index(tensor: DTensor, axis: str) -> int | None:
    names = tensor.device_mesh.mesh_dim_names
    return None if names is None or axis not in names else names.index(axis)


def _sharded_only_over(tensor: DTensor, axis: int, dim: int) -> bool:
    """Whether ``tensor``'s ``dim`` is sharded over mesh axis ``axis`` and over no other
    (mesh axes of size 1 do not count)."""
    mesh = tensor.device_mesh
    for index, placement in enumerate(tensor.placements):
        sharded = isinstance(placement, Shard) and placement.dim % tensor.dim() == dim
        if mesh.size(index) > 1 and sharded != (index == axis):
            return False
    return True


def vocab_shard_bounds(logits: DTensor, *, axis: str = "tp") -> tuple[int, int]:
    """``[start, end)``: this rank's slice of the vocabulary (last dim), sharded over ``axis``.

    Eager equivalent: ``(offset, offset + logits.to_local().shape[-1])`` with ``offset`` the
    local shard's global offset along the last dim (computed here without reading a tensor).
    """
    if not isinstance(logits, DTensor):
        raise TypeError(f"logits must be a DTensor, got {type(logits).__name__}")
    index = _axis_index(logits, axis)
    if index is None:
        raise ValueError(
            f"the logits' device mesh has axes {logits.device_mesh.mesh_dim_names}, none named "
            f"{axis!r}: build it with init_device_mesh(..., mesh_dim_names=(..., {axis!r}))"
        )
    if not _sharded_only_over(logits, index, logits.dim() - 1):
        raise ValueError(
            f"the logits must be sharded on the vocabulary (Shard({logits.dim() - 1})) over mesh "
            f"axis {axis!r} and over no other axis, got placements {logits.placements} "
            f"on mesh axes {logits.device_mesh.mesh_dim_names}: compute the LM head with "
            "loss_parallel / ColwiseParallel(use_local_output=False)"
        )
    # DTensor's Shard splits like torch.chunk: ceil(V / n) per rank, the last ones short or empty.
    vocab, ranks = logits.shape[-1], logits.device_mesh.size(index)
    width = -(-vocab // ranks)
    start = min(vocab, logits.device_mesh.get_local_rank(index) * width)
    return start, min(vocab, start + width)


def _check_no_empty_vocab_slice(logits: DTensor, *, axis: str = "tp") -> None:
    """Raise, on every rank alike and before any collective, if some rank of ``axis`` holds
    no vocabulary (``torch.chunk`` semantics: V = 9 over 4 ranks gives 3, 3, 3, 0). Each rank
    computes all ranks' slices from the global shape, so none is left waiting in a
    collective that an erroring rank never joins."""
    vocab, ranks = logits.shape[-1], logits.device_mesh.size(_axis_index(logits, axis))
    width = -(-vocab // ranks)
    holding = -(-vocab // width) if vocab else 0  # ranks with a non-empty slice
    if holding < ranks:
        empty = f"rank {holding}" if holding == ranks - 1 else f"ranks {holding}..{ranks - 1}"
        raise ValueError(
            f"the vocabulary of V = {vocab} sharded over the {ranks} ranks of mesh axis "
            f"{axis!r} leaves {empty} with an empty slice (DTensor's Shard splits like "
            f"torch.chunk: ceil({vocab} / {ranks}) = {width} per rank): pad the vocabulary to "
            f"a multiple of {ranks} (V = {width * ranks}) or shard it over fewer ranks"
        )


def _natural_ids(
    target: torch.Tensor, seq_index: torch.Tensor | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, torch.Tensor | None]:
    """``(input_ids [B, S] in natural order, cp_group, seq_index)`` of a tensor or a DTensor
    target; ``cp_group`` and ``seq_index`` are ``None`` unless it is sharded over ``"cp"``."""
    if not isinstance(target, DTensor):
        return target, None, None
    axis = _axis_index(target, "cp")
    size = 1 if axis is None else target.device_mesh.size(axis)
    if not _sharded_only_over(target, -1 if axis is None else axis, target.dim() - 1):
        raise ValueError(
            f"a DTensor target must be sharded on the sequence (Shard({target.dim() - 1})) over "
            f"mesh axis 'cp' and over no other axis, got placements {target.placements} "
            f"on mesh axes {target.device_mesh.mesh_dim_names}"
        )
    if size == 1:
        return target.to_local(), None, None
    if seq_index is None:
        raise ValueError(
            "seq_index must be given when the target is sharded over CP: it is the natural "
            "position of each position of the CP-ordered sequence"
        )
    cp_group = target.device_mesh.get_group(axis)
    if target.shape[-1] % size:
        raise ValueError(
            f"the target's sequence length {target.shape[-1]} must be a multiple of the CP "
            f"size {size}"
        )
    local = target.to_local()
    # Its values are checked with the log-probs' verdict, after their CP gather.
    context_parallel.check_seq_index(seq_index, target.shape[-1], local)
    positions = seq_index.clamp(0, target.shape[-1] - 1).view(size, -1)
    ids = layout.gather_to_positions(local, positions, cp_group.group_name, -1)
    return ids, cp_group, seq_index


def local_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    seq_index: torch.Tensor | None,
    chunk_size: int | None,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``options``: ``ignore_index``, ``temperature``, ``return_entropy``, ``next_token``,
    ``top_k``, ``top_p``."""
    plain = isinstance(target, torch.Tensor) and not isinstance(target, DTensor)
    if plain and target.dim() and logits.dim() >= 2 and logits.shape[-2] < target.shape[-1]:
        # A plain target means no CP (as in NeMo-RL): the CP group comes from a DTensor
        # target's mesh. (Shapes are validated later: only the clearer message is at stake.)
        raise ValueError(
            f"the logits hold {logits.shape[-2]} positions, fewer than the {target.shape[-1]} "
            f"of the target {tuple(target.shape)}, a plain tensor (which means no CP): under "
            "CP pass the target as a DTensor sharded on the sequence over mesh axis 'cp' in "
            "seq_index order, e.g. distribute_tensor(ids[:, seq_index], mesh['cp'], [Shard(1)]), "
            "and seq_index"
        )
    input_ids, cp_group, seq_index = _natural_ids(target, seq_index)
    return context_parallel.context_parallel_logprobs(
        logits,
        input_ids,
        vocab_start=vocab_start,
        group=group,
        cp_group=cp_group,
        seq_index=seq_index,
        chunk_size=chunk_size,
        **options,
    )


@overload
def dtensor_logprobs(
    logits: DTensor,
    input_ids: torch.Tensor,
    *,
    seq_index: torch.Tensor | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: Literal[False] = ...,
    next_token: bool = ...,
    top_k: int | None = ...,
    top_p: float = ...,
    inplace_backward: bool = ...,
) -> torch.Tensor: ...


@overload
def dtensor_logprobs(
    logits: DTensor,
    input_ids: torch.Tensor,
    *,
    seq_index: torch.Tensor | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: Literal[True],
    next_token: bool = ...,
    top_k: int | None = ...,
    top_p: float = ...,
    inplace_backward: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def dtensor_logprobs(
    logits: DTensor,
    input_ids: torch.Tensor,
    *,
    seq_index: torch.Tensor | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: bool = ...,
    next_token: bool = ...,
    top_k: int | None = ...,
    top_p: float = ...,
    inplace_backward: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@_agreement.agreed
def dtensor_logprobs(
    logits: DTensor,
    input_ids: torch.Tensor,
    *,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    next_token: bool = True,
    top_k: int | None = None,
    top_p: float = 1.0,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of DTensor logits, fp32 ``[B, S - 1]`` in natural order.

    Eager equivalent: ``log_softmax(full.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]``
    with ``full``, ``ids`` the full logits and token ids put back in natural order.

    Args:
        logits: DTensor ``[B, S, V]`` sharded on the vocabulary over mesh axis ``"tp"``
            (and, under CP, on the sequence over ``"cp"``: local ``[B, S / C, V_local]``).
        input_ids: ``[B, S]`` token ids: a tensor in natural order (no CP), or a DTensor
            sharded on the sequence over mesh axis ``"cp"`` holding the sequence in CP order
            (under CP it must be one: its mesh gives the CP group).
        seq_index: ``[S]`` natural position of each CP-ordered position; required under CP.
        chunk_size: as in :func:`compiled_logprob.token_logprobs`.
        ignore_index, temperature, return_entropy, next_token, top_k, top_p,
            inplace_backward: as in :func:`compiled_logprob.context_parallel_logprobs` (a
            plain tensor ``temperature`` in natural order); with ``return_entropy``, returns
            ``(logprobs, entropy)``. ``top_k``/``top_p`` need ``V`` divisible by the TP size.

    A vocabulary split that leaves a TP rank no slice (V = 9 over 4 ranks: 3, 3, 3, 0) is a
    ``ValueError`` on every rank, before any collective.
    """
    start, _ = vocab_shard_bounds(logits)
    _check_no_empty_vocab_slice(logits)
    # On the DTensor: its local tensor is never a leaf.
    _validation.check_inplace_backward(logits, inplace_backward)
    tp_group = logits.device_mesh.get_group("tp")
    if (top_k is not None or top_p != 1) and logits.shape[-1] % tp_group.size():
        # Every rank sees this (a per-rank check of its own bounds would leave the ranks
        # that pass it waiting in the collective).
        raise ValueError(
            f"top_k/top_p need the vocabulary split evenly over the {tp_group.size()} TP ranks, "
            f"but V = {logits.shape[-1]}: pad the vocabulary to a multiple of the TP size"
        )
    return local_logprobs(
        logits.to_local(),
        input_ids,
        start,
        tp_group,
        seq_index,
        chunk_size,
        ignore_index=ignore_index,
        temperature=temperature,
        return_entropy=return_entropy,
        next_token=next_token,
        top_k=top_k,
        top_p=top_p,
        inplace_backward=inplace_backward,
    )
