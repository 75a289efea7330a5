"""Next-token log-probs of packed rows (TransformerEngine's THD layout) sharded over TP
and CP: several sequences per row, each padded and load-balanced over CP on its own.

Rank ``r``'s buffer holds padded sequence ``i`` at ``[cu[i] / C, cu[i+1] / C)``, in the
load-balanced layout of :mod:`compiled_logprob.context_parallel`. The sequence boundaries
``cu_seqlens_padded`` stay on the device: their values are checked there and never read by
the host, so nothing syncs and nothing specialises on them.

Shape legend: ``B`` sequences, ``T`` tokens of the packed row, ``C`` CP ranks, ``V_local``
this rank's vocabulary slice.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_logprob import _agreement, _comm, _validation, context_parallel
from compiled_logprob._math import layout, merge

__all__ = ["packed_context_parallel_logprobs"]


def _check_packed(
    shard: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    size: int,
    name: str,
    pre_rolled: bool,
) -> int:
    """Checks the packed layout's arguments; returns ``max_seqlen`` as a Python int."""
    if shard.dim() != 3 or shard.shape[0] != 1:
        raise ValueError(f"packed {name} must be [1, T / C, *], got {tuple(shard.shape)}")
    if pre_rolled and input_ids.shape[-1] != shard.shape[1]:
        raise ValueError(
            f"pre-rolled targets {tuple(input_ids.shape)} must hold this rank's "
            f"{shard.shape[1]} local positions (the {name}' {tuple(shard.shape)}), shifted "
            "and CP-sharded like them"
        )
    if not pre_rolled and input_ids.shape[-1] != size * shard.shape[1]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must hold all T = {size} CP ranks x "
            f"{shard.shape[1]} local positions = {size * shard.shape[1]} packed tokens"
        )
    context_parallel.check_local_len(shard.shape[1], size, f"packed {name} of shape {tuple(shard.shape)}")
    context_parallel.check_index_tensor(cu_seqlens, "cu_seqlens_padded")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D [B + 1] with B >= 1 (0, end of sequence 0, ...), "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != shard.device:
        raise ValueError(
            f"cu_seqlens_padded is on {cu_seqlens.device} but {name} on {shard.device}"
        )
    return _validation.as_int(max_seqlen, "unpacked_seqlen/max_seqlen", minimum=1)


def _packing_problems(cu: torch.Tensor, total: int, size: int) -> torch.Tensor:
    """The verdict bits of ``cu_seqlens_padded``'s values, computed on the device (no host
    sync) and checked after the CP gather, so that every CP rank raises together even where
    only one holds a malformed copy: it must start at 0, never decrease, end at ``total`` and,
    under CP, split into equal load-balanced chunks."""
    well_formed = (cu[0] == 0) & (cu[-1] == total) & (cu.diff() >= 0).all()
    if size > 1:
        well_formed = well_formed & (cu % (2 * size) == 0).all()
    return merge.verdict_of(well_formed, bad_packing=~well_formed)


@overload
def packed_context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    max_seqlen: int,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
def packed_context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    max_seqlen: int,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
def packed_context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    max_seqlen: int,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
def packed_context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    max_seqlen: int,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    next_token: bool = True,
    top_k: int | None = None,
    top_p: float = 1.0,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of a packed (THD) TP×CP-sharded row, as fp32 ``[B, max_seqlen - 1]``.

    Eager equivalent: row ``i`` is ``log_softmax(seq.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]``
    zero-filled or cut to ``max_seqlen - 1``, for padded sequence ``i`` (``seq``, ``ids``: the
    full row's logits and ids at ``[cu[i], cu[i+1])``).

    Args:
        logits: ``[1, T / C, V_local]``; every padded sequence load-balanced-sharded on its
            own, this rank's part of sequence ``i`` at ``[cu[i] / C, cu[i+1] / C)``.
        input_ids: ``[1, T]`` the full packed, unshifted token ids.
        cu_seqlens_padded: ``[B + 1]`` int32/int64 tensor of padded sequence boundaries
            (full row, not divided by ``C``), each length a multiple of ``2 * C``. It stays
            on the device: its values are checked there and never read by the host.
        max_seqlen: the unpacked length; the output has ``max_seqlen - 1`` columns.
        vocab_start, group, cp_group, chunk_size, ignore_index, return_entropy, top_k,
            top_p, inplace_backward: as in :func:`context_parallel_logprobs`.
        temperature: a float, or a tensor that broadcasts to the output
            ``[B, max_seqlen - 1]`` (e.g. ``[B, 1]``, one per sequence).
        next_token: ``False`` scores each sequence's token t at its position t (as in
            :func:`context_parallel_logprobs`): nothing is dropped, and the output and a
            tensor ``temperature`` are ``[B, max_seqlen]``.

    Within each sequence, position t scores token t + 1; the last position's (wrapped)
    target is dropped. One all-gather of fp32 log-probs (and entropies) over CP in total.
    """
    local_fn = context_parallel.logits_local_fn(
        logits, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
        inplace_backward=inplace_backward,
    )
    return packed_cp_logprobs(
        local_fn,
        logits,
        input_ids,
        cu_seqlens_padded,
        max_seqlen=max_seqlen,
        cp_group=cp_group,
        temperature=temperature,
        return_entropy=return_entropy,
        next_token=next_token,
        name="logits",
    )


def packed_cp_logprobs(
    local_fn,
    shard: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    max_seqlen: int,
    cp_group: dist.ProcessGroup | None,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    next_token: bool,
    name: str,
    pre_rolled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`packed_context_parallel_logprobs` of this rank's ``shard`` ``[1, T / C, *]``
    (``name``), whose log-probs ``local_fn`` computes as in :func:`cp_logprobs`.

    ``pre_rolled``: ``input_ids`` are this rank's ``[1, T / C]`` targets, already shifted
    within each sequence and sharded like ``shard`` (NeMo-RL's ``target_is_pre_rolled``).
    """
    size, rank = _comm.size_rank(cp_group)
    max_seqlen = _check_packed(
        shard, input_ids, cu_seqlens_padded, max_seqlen, size, name, pre_rolled
    )
    local_len = shard.shape[1]
    total = size * local_len
    batch = cu_seqlens_padded.numel() - 1
    cu = cu_seqlens_padded.long()
    problems = _packing_problems(cu, total, size)

    local = torch.arange(local_len, device=shard.device)
    seq = torch.searchsorted(cu[1:] // size, local, right=True).clamp(max=batch - 1)
    start, end = cu[seq], cu[seq + 1]
    ranks = torch.arange(size, device=shard.device).unsqueeze(-1)
    positions = layout.load_balanced_positions(local, start, end - start, ranks, size)  # [C, T / C]
    mine = positions[rank]
    # With next_token, position t scores token t + 1 of its sequence and a sequence's last
    # position scores token 0 (dropped below). The clamps keep indices in range even where
    # cu_seqlens_padded is malformed, so that the device-side check above is what reports it.
    shift = 1 if next_token else 0
    scored = mine + shift < end
    if pre_rolled:
        ids = input_ids
    else:
        ids = input_ids.index_select(-1, (mine + shift).clamp(0, max(total - 1, 0)))
    # Output column of each local position; columns past the output get temperature 1.
    out_column = (mine - start).clamp(0, max_seqlen - shift)
    result = context_parallel.local_logprobs(
        local_fn,
        torch.where(scored, ids, 0),
        temperature=context_parallel.local_temperature(
            temperature,
            (batch, max_seqlen - shift),
            lambda t: F.pad(t, (0, 1), value=1)[seq, out_column].unsqueeze(0),
        ),
        return_entropy=return_entropy,
        problems=problems,
    )
    group_name = None if cp_group is None or size == 1 else cp_group.group_name
    gathered = layout.gather_to_positions(result, positions, group_name, -1)[..., 0, :]  # [n, T]
    # A 0 at T for the columns past a sequence (or T = 0).
    packed = F.pad(torch.stack(context_parallel.checked(gathered)), (0, 1))

    column = torch.arange(max_seqlen - shift, device=shard.device)
    source = (cu[:-1].unsqueeze(-1) + column).clamp(0, total)  # [B, max_seqlen - shift]
    keep = column < (cu[1:] - cu[:-1] - shift).unsqueeze(-1)
    return context_parallel.split_entropy(list(torch.where(keep, packed[..., source], 0.0).unbind(0)))
