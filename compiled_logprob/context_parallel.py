"""Context parallelism (CP): load-balanced sequence shards, their gather, and next-token
log-probs of TP×CP-sharded logits, plain and packed (THD).

Layout. With ``C`` CP ranks a sequence (padded to a multiple of ``2C``) is cut into ``2C``
equal chunks and CP rank ``r`` holds chunks ``r`` and ``2C-1-r``, concatenated: under causal
attention that gives every rank the same work. A packed row (TransformerEngine's THD
layout) shards each padded sequence this way on its own, and rank ``r``'s buffer holds
sequence ``i`` at ``[cu[i] / C, cu[i+1] / C)``.

Every layout is a map ``positions[r, q]`` from (rank, local position) to a position in the
full row, built on the device by index arithmetic (no host data, so nothing syncs and
nothing specialises on sequence lengths). A shard is an ``index_select`` of this rank's
row; the gather is one all-gather followed by an ``index_select`` through the inverse
permutation of the positions. Its backward is that ``index_select``'s (an ``index_add``)
followed by one reduce-scatter (the all-gather's own backward), so each rank receives the
sum over CP ranks of the upstream gradients at its positions.

Shape legend: ``B`` batch, ``S`` full sequence, ``C`` CP ranks, ``L`` this rank's part of
the (padded) sequence, ``T`` tokens of a packed row, ``V_local`` this rank's vocabulary
slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_logprob import _comm, _validation, logits as _logits
from compiled_logprob._math import layout
from compiled_logprob._math.kernels import assert_async

__all__ = [
    "context_parallel_logprobs",
    "gather_context_parallel",
    "packed_context_parallel_logprobs",
    "shard_for_context_parallel",
]


def _normalized_dim(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def _check_local_len(local_len: int, size: int, what: str) -> None:
    if size > 1 and local_len % 2:
        raise ValueError(
            f"{what} has local sequence length {local_len} on each of {size} CP ranks, which "
            f"cannot hold 2 equal load-balanced chunks: pad the full sequence to a multiple of "
            f"2 * cp_size = {2 * size} before sharding it"
        )


def shard_rank(tensor: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    if size == 1:
        return tensor
    dim = _normalized_dim(tensor, dim)
    full_len = tensor.shape[dim]
    if full_len % (2 * size):
        raise ValueError(
            f"the sequence length {full_len} (dim {dim} of shape {tuple(tensor.shape)}) is not "
            f"a multiple of 2 * cp_size = {2 * size}: pad it first"
        )
    return layout.shard(tensor, rank, size, dim)


def shard_for_context_parallel(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """This CP rank's load-balanced shard of a sequence, ``[..., S, ...] -> [..., S / C, ...]``.

    Eager equivalent: ``torch.cat([c[rank], c[2 * C - 1 - rank]], dim)`` with
    ``c = tensor.chunk(2 * C, dim)``. ``S`` must be a multiple of ``2 * C``; ``group=None``
    (or a group of size 1) returns ``tensor`` itself.
    """
    size, rank = _comm.size_rank(group)
    return shard_rank(tensor, rank, size, dim)


def gather_context_parallel(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """All CP ranks' load-balanced shards in natural order, ``[..., L, ...] -> [..., C * L, ...]``.

    Eager equivalent: the inverse of :func:`shard_for_context_parallel` applied to the
    concatenation of all ranks' shards. One all-gather forward; backward, one reduce-scatter:
    each rank's shard receives the sum over the CP ranks of the gradients at its positions.
    """
    size, _ = _comm.size_rank(group)
    if size == 1:
        return tensor
    dim = _normalized_dim(tensor, dim)
    _check_local_len(tensor.shape[dim], size, f"tensor of shape {tuple(tensor.shape)} (dim {dim})")
    positions = layout.positions(tensor.shape[dim], size, tensor.device)
    return layout.gather_to_positions(tensor, positions, group.group_name, dim)


def shard_natural(
    per_position: torch.Tensor, local_len: int, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This CP rank's load-balanced part ``[B, L, ...]`` of a natural-order ``[B, S, ...]``
    tensor (ids), its sequence zero-padded to ``L`` positions times the CP size first."""
    cp_size, _ = _comm.size_rank(cp_group)
    seq_len = per_position.shape[1]
    padding = local_len * cp_size - seq_len
    if padding < 0:
        raise ValueError(
            f"the logits hold {local_len} positions on each of {cp_size} CP ranks, fewer than "
            f"the {seq_len} of the ids {tuple(per_position.shape)}"
        )
    padded = F.pad(per_position, (0, 0) * (per_position.dim() - 2) + (0, padding))
    return shard_for_context_parallel(padded, group=cp_group)


def gather_natural(
    local: torch.Tensor, seq_len: int, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The inverse of :func:`shard_natural` for a result ``[B, L, ...]``: every CP rank's
    positions in natural order, the first ``seq_len`` (differentiable)."""
    return gather_context_parallel(local, group=cp_group)[:, :seq_len]


def check_ids(tensor: torch.Tensor, input_ids: torch.Tensor, name: str) -> None:
    """``input_ids`` against ``tensor`` ``[..., L, *]``, this rank's (validated) ``name``."""
    _validation.check_token_ids(input_ids, "input_ids")
    if input_ids.dim() != tensor.dim() - 1 or input_ids.shape[:-1] != tensor.shape[:-2]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must be [..., S] with the leading shape of the "
            f"{name} {tuple(tensor.shape)} ([..., L, *])"
        )
    if input_ids.device != tensor.device:
        raise ValueError(f"input_ids are on {input_ids.device} but {name} on {tensor.device}")


def logits_local_fn(
    logits, input_ids, *, vocab_start, group, chunk_size, ignore_index, top_k, top_p,
    return_entropy,
):
    """The local log-probs of validated ``logits``: ``fn(target, *, temperature,
    return_entropy)`` for this rank's targets ``[..., L]``, the ``local_fn`` of
    :func:`cp_logprobs`."""
    _validation.check_logits(logits)
    check_ids(logits, input_ids, "logits")
    _validation.check_ignore_index(ignore_index, input_ids)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )
    filtering = _validation.filter_options(top_k, top_p, logits, opts, group, return_entropy)

    def local_fn(target, *, temperature, return_entropy):
        return _logits._token_logprobs(
            logits, target, opts, temperature, return_entropy, filtering
        )

    return local_fn


def _check_index_tensor(value: object, name: str) -> None:
    """``value`` must be an int32/int64 tensor (what index_select and searchsorted take)."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        got = getattr(value, "dtype", type(value).__name__)
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {got}")


def check_seq_index(seq_index: torch.Tensor, full_len: int, like: torch.Tensor) -> None:
    _check_index_tensor(seq_index, "seq_index")
    if seq_index.shape != (full_len,):
        raise ValueError(
            f"seq_index has shape {tuple(seq_index.shape)}, expected ({full_len},): one natural "
            f"position per position of the CP-ordered sequence (CP size x local length)"
        )
    if seq_index.device != like.device:
        raise ValueError(f"seq_index is on {seq_index.device}, expected {like.device}")
    natural = torch.arange(full_len, device=seq_index.device)
    assert_async(
        (seq_index.sort().values == natural).all(),
        "seq_index must be a permutation of 0 .. CP size x local length - 1 (each natural "
        "position exactly once)",
    )


def _local_temperature(
    temperature: float | torch.Tensor, out_shape: torch.Size, select
) -> float | torch.Tensor:
    """A float as it is; a tensor broadcast to the output's positions ``out_shape``, then
    ``select``-ed down to this rank's logits positions."""
    if not isinstance(temperature, torch.Tensor):
        return temperature
    try:
        per_position = temperature.expand(out_shape)
    except RuntimeError:
        raise ValueError(
            f"temperature of shape {tuple(temperature.shape)} does not broadcast to the output "
            f"positions {tuple(out_shape)}: pass a float, or a tensor of shape [..., 1] (one "
            "per row) or of the output's shape (one per position, in natural order)"
        ) from None
    return select(per_position)


def _local_logprobs(local_fn, target, *, temperature, return_entropy) -> torch.Tensor:
    """``local_fn`` of this rank's positions, ``[..., L]``; with ``return_entropy`` the
    log-probs and the entropy stacked as ``[2, ..., L]``, so one collective moves both."""
    out = local_fn(target, temperature=temperature, return_entropy=return_entropy)
    return torch.stack(out) if return_entropy else out


def _split(result: torch.Tensor, return_entropy: bool):
    return tuple(result.unbind(0)) if return_entropy else result


def context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    next_token: bool = True,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of TP×CP-sharded logits, fp32 ``[..., S - 1]`` in natural order.

    Eager equivalent: ``log_softmax(full.float(), -1)[..., :-1, :].gather(-1, ids[..., 1:, None])[..., 0]``
    with ``full`` all ranks' logits in natural order (full vocabulary, unpadded) and ``ids``
    the ``input_ids``.

    Args:
        logits: ``[..., L, V_local]``, this rank's vocabulary slice of its part of the
            sequence. By default that part is the load-balanced shard
            (:func:`shard_for_context_parallel`) of the sequence padded to ``C * L``; with
            ``seq_index`` it is ``[rank * L, (rank + 1) * L)`` of the permuted sequence.
        input_ids: ``[..., S]`` the full, unshifted token ids in natural order, ``S <= C * L``.
        vocab_start: first global vocabulary id of this rank's slice.
        group: the vocab-parallel (TP) group; ``None`` means an unsharded vocabulary.
        cp_group: the context-parallel group; ``None`` means no CP.
        seq_index: ``[C * L]`` natural position of each position of the CP-ordered sequence
            (``torch.distributed.tensor.experimental.context_parallel``'s layout).
        chunk_size, ignore_index: as in :func:`compiled_logprob.token_logprobs`; position
            ``t`` is ignored where the id it scores, ``input_ids[..., t + 1]``, is ``ignore_index``.
        temperature: a float, or a tensor that broadcasts to the output ``[..., S - 1]``
            (natural order): position ``t``'s logits are divided by ``temperature[..., t]``.
        return_entropy: also return the entropy ``[..., S - 1]`` of each position's
            full-vocabulary distribution (0 where ignored), gathered with the log-probs.
        next_token: ``False`` scores ``input_ids[..., t]`` at position ``t`` instead of
            ``input_ids[..., t + 1]`` (masked diffusion LMs; NeMo-RL's
            ``shift_targets=False``): no position is dropped, and every ``[..., S - 1]``
            above, the output's shape included, is ``[..., S]``.
        top_k, top_p: log-probs under the top-k/top-p filtered distribution, as in
            :func:`compiled_logprob.token_logprobs` (not with ``return_entropy``).

    One all-gather of ``[..., L]`` fp32 log-probs (``[2, ..., L]`` with the entropy) over CP
    forward, one reduce-scatter backward; a rank's logits receive the sum over CP ranks of
    the upstream gradients at its positions. With ``return_entropy``, returns
    ``(logprobs, entropy)``.
    """
    local_fn = logits_local_fn(
        logits, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
    )
    return cp_logprobs(
        local_fn,
        logits,
        input_ids,
        cp_group=cp_group,
        seq_index=seq_index,
        temperature=temperature,
        return_entropy=return_entropy,
        next_token=next_token,
        name="logits",
    )


def cp_logprobs(
    local_fn,
    shard: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | None,
    seq_index: torch.Tensor | None,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    next_token: bool,
    name: str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`context_parallel_logprobs` of this rank's ``shard`` ``[..., L, *]`` (its logits
    or hidden states, ``name``), whose log-probs ``local_fn(target, *, temperature,
    return_entropy)`` computes for this rank's targets ``[..., L]``."""
    size, rank = _comm.size_rank(cp_group)
    local_len, seq_len = shard.shape[-2], input_ids.shape[-1]
    padded_len = size * local_len
    if padded_len < seq_len:
        where = (
            f"on each of {size} CP ranks ({padded_len} in all)"
            if size > 1
            else "and there is no CP (cp_group is None or of size 1)"
        )
        raise ValueError(
            f"the {name} hold {local_len} positions {where}, fewer than the {seq_len} "
            f"positions of input_ids {tuple(input_ids.shape)}"
        )
    if seq_index is None:
        _check_local_len(local_len, size, f"{name} of shape {tuple(shard.shape)}")
        positions = layout.positions(local_len, size, shard.device)
    else:
        check_seq_index(seq_index, padded_len, shard)
        positions = seq_index.view(size, local_len)

    def this_rank(per_position: torch.Tensor, fill: int) -> torch.Tensor:
        padded = F.pad(per_position, (0, padded_len - per_position.shape[-1]), value=fill)
        return padded.index_select(-1, positions[rank])

    # With next_token (NeMo's shift), position t scores token t + 1. Positions past the
    # scored ones (the last, the padding) score token 0 at temperature 1 (whatever
    # input_ids hold), and are cut off below.
    scored = input_ids[..., (1 if next_token else 0) :]
    result = _local_logprobs(
        local_fn,
        this_rank(scored, 0),
        temperature=_local_temperature(temperature, scored.shape, lambda t: this_rank(t, 1)),
        return_entropy=return_entropy,
    )
    group_name = None if size == 1 else cp_group.group_name
    result = layout.gather_to_positions(result, positions, group_name, -1)[..., : scored.shape[-1]]
    return _split(result, return_entropy)


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
    _check_local_len(shard.shape[1], size, f"packed {name} of shape {tuple(shard.shape)}")
    _check_index_tensor(cu_seqlens, "cu_seqlens_padded")
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


def _assert_packing(cu: torch.Tensor, total: int, size: int) -> None:
    """Checked on the device (no host sync): the values of ``cu_seqlens_padded``."""
    well_formed = (cu[0] == 0) & (cu[-1] == total) & (cu.diff() >= 0).all()
    assert_async(
        well_formed,
        # No T in the message: formatting a dynamic size would specialise the graph on it.
        "cu_seqlens_padded must start at 0, never decrease and end at T, the packed row's "
        "length (input_ids.shape[-1])",
    )
    if size > 1:
        assert_async(
            (cu % (2 * size) == 0).all(),
            f"every padded sequence length in cu_seqlens_padded must be a multiple of "
            f"2 * cp_size = {2 * size}, so that it splits into equal load-balanced chunks",
        )


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
            top_p: as in :func:`context_parallel_logprobs`.
        temperature: a float, or a tensor that broadcasts to the output
            ``[B, max_seqlen - 1]`` (e.g. ``[B, 1]``, one per sequence).
        next_token: ``False`` scores each sequence's token t at its position t (as in
            :func:`context_parallel_logprobs`): nothing is dropped, and the output and a
            tensor ``temperature`` are ``[B, max_seqlen]``.

    Within each sequence, position t scores token t + 1; the last position's (wrapped)
    target is dropped. One all-gather of fp32 log-probs (and entropies) over CP in total.
    """
    local_fn = logits_local_fn(
        logits, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
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
    _assert_packing(cu, total, size)

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
    result = _local_logprobs(
        local_fn,
        torch.where(scored, ids, 0),
        temperature=_local_temperature(
            temperature,
            (batch, max_seqlen - shift),
            lambda t: F.pad(t, (0, 1), value=1)[seq, out_column].unsqueeze(0),
        ),
        return_entropy=return_entropy,
    )
    group_name = None if size == 1 else cp_group.group_name
    packed = layout.gather_to_positions(result, positions, group_name, -1)[..., 0, :]  # [(2,) T]
    packed = F.pad(packed, (0, 1))  # a 0 at T for the columns past a sequence (or T = 0)

    column = torch.arange(max_seqlen - shift, device=shard.device)
    source = (cu[:-1].unsqueeze(-1) + column).clamp(0, total)  # [B, max_seqlen - shift]
    keep = column < (cu[1:] - cu[:-1] - shift).unsqueeze(-1)
    return _split(torch.where(keep, packed[..., source], 0.0), return_entropy)
