"""Context parallelism (CP): load-balanced sequence shards, their gather, and next-token
log-probs of TP×CP-sharded logits (packed rows: :mod:`compiled_logprob.packed`).

Layout. With ``C`` CP ranks a sequence (padded to a multiple of ``2C``) is cut into ``2C``
equal chunks and CP rank ``r`` holds chunks ``r`` and ``2C-1-r``, concatenated: under causal
attention that gives every rank the same work.

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

from collections.abc import Callable
from typing import Literal, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_logprob import _agreement, _comm, _scoring, _validation
from compiled_logprob._math import layout, merge

__all__ = [
    "context_parallel_logprobs",
    "gather_context_parallel",
    "shard_for_context_parallel",
]


def _normalized_dim(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def check_local_len(local_len: int, size: int, what: str) -> None:
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


@_agreement.agreed
def gather_context_parallel(
    tensor: torch.Tensor, *, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """All CP ranks' load-balanced shards in natural order, ``[..., L, ...] -> [..., C * L, ...]``.

    Eager equivalent: the inverse of :func:`shard_for_context_parallel` applied to the
    concatenation of all ranks' shards. One all-gather forward; backward, one reduce-scatter:
    each rank's shard receives the sum over the CP ranks of the gradients at its positions.
    """
    size, _ = _comm.size_rank(group)
    if group is None or size == 1:
        return tensor
    dim = _normalized_dim(tensor, dim)
    check_local_len(tensor.shape[dim], size, f"tensor of shape {tuple(tensor.shape)} (dim {dim})")
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
    return_entropy, inplace_backward,
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
    filtering = _validation.filter_options(top_k, top_p, logits.shape[-1], opts, group, return_entropy)
    _validation.check_inplace_backward(logits, inplace_backward)

    def local_fn(target, *, temperature, return_entropy):
        return _scoring.token_logprobs_of(
            logits, target, opts, temperature, return_entropy, filtering, inplace_backward
        )

    return local_fn


def check_index_tensor(value: object, name: str) -> None:
    """``value`` must be an int32/int64 tensor (what index_select and searchsorted take)."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        got = getattr(value, "dtype", type(value).__name__)
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {got}")


def check_seq_index(seq_index: torch.Tensor, full_len: int, like: torch.Tensor) -> torch.Tensor:
    """Checks ``seq_index``'s type, shape and device, and returns the verdict bits of its
    values (a permutation of the positions), computed on the device and checked after the
    CP gather, so that every CP rank raises together even where one holds a bad copy."""
    check_index_tensor(seq_index, "seq_index")
    if seq_index.shape != (full_len,):
        raise ValueError(
            f"seq_index has shape {tuple(seq_index.shape)}, expected ({full_len},): one natural "
            f"position per position of the CP-ordered sequence (CP size x local length)"
        )
    if seq_index.device != like.device:
        raise ValueError(f"seq_index is on {seq_index.device}, expected {like.device}")
    natural = torch.arange(full_len, device=seq_index.device)
    permutation = (seq_index.sort().values == natural).all()
    return merge.verdict_of(permutation, bad_seq_index=~permutation)


def local_temperature(
    temperature: float | torch.Tensor,
    out_shape: tuple[int, ...],
    select: Callable[[torch.Tensor], torch.Tensor],
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


def local_logprobs(
    local_fn, target, *, temperature, return_entropy, problems: torch.Tensor | None = None
) -> torch.Tensor:
    """``local_fn`` of this rank's positions, its log-probs, entropy (with
    ``return_entropy``) and verdict stacked as ``[n, ..., L]``, so that one collective moves
    them all and every CP rank checks every rank's verdict. ``problems``: verdict bits of
    this call's own (replicated) inputs, added to every position's."""
    scored = local_fn(target, temperature=temperature, return_entropy=return_entropy)
    verdict = scored.verdict if problems is None else scored.verdict + problems
    entropy = [scored.entropy] if return_entropy else []
    return torch.stack([scored.logprobs, *entropy, verdict])


def checked(gathered: torch.Tensor) -> list[torch.Tensor]:
    """The values of :func:`local_logprobs`' ``[n, ...]`` once gathered, after the verdict of
    every position is asserted on the device: every CP rank raises the same error."""
    *values, verdict = gathered.unbind(0)
    merge.assert_verdict(verdict)
    return values


def gather_checked(
    values: torch.Tensor, verdict: torch.Tensor, seq_len: int, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """:func:`gather_natural` of ``values`` ``[B, L, K]``, with their ``verdict`` ``[B, L]``
    asserted on every CP rank after the gather (so that all raise together)."""
    both = gather_natural(torch.cat([values, verdict.unsqueeze(-1)], dim=-1), seq_len, cp_group)
    merge.assert_verdict(both[..., -1])
    return both[..., :-1]


def split_entropy(values: list[torch.Tensor]):
    return tuple(values) if len(values) > 1 else values[0]


@overload
def context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
def context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
def context_parallel_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    cp_group: dist.ProcessGroup | None = ...,
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
    inplace_backward: bool = False,
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
        inplace_backward: the backward writes the logits' gradient into their own storage,
            as in :func:`compiled_logprob.token_logprobs`.

    One all-gather of ``[..., L]`` fp32 log-probs (``[2, ..., L]`` with the entropy) over CP
    forward, one reduce-scatter backward; a rank's logits receive the sum over CP ranks of
    the upstream gradients at its positions. With ``return_entropy``, returns
    ``(logprobs, entropy)``.
    """
    local_fn = logits_local_fn(
        logits, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
        inplace_backward=inplace_backward,
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
    problems = None
    if seq_index is None:
        check_local_len(local_len, size, f"{name} of shape {tuple(shard.shape)}")
        positions = layout.positions(local_len, size, shard.device)
    else:
        problems = check_seq_index(seq_index, padded_len, shard)
        # Clamped, so that a bad seq_index reaches the verdict rather than an index error.
        positions = seq_index.clamp(0, padded_len - 1).view(size, local_len)

    def this_rank(per_position: torch.Tensor, fill: int) -> torch.Tensor:
        padded = F.pad(per_position, (0, padded_len - per_position.shape[-1]), value=fill)
        return padded.index_select(-1, positions[rank])

    # With next_token (NeMo's shift), position t scores token t + 1. Positions past the
    # scored ones (the last, the padding) score token 0 at temperature 1 (whatever
    # input_ids hold), and are cut off below.
    scored = input_ids[..., (1 if next_token else 0) :]
    result = local_logprobs(
        local_fn,
        this_rank(scored, 0),
        temperature=local_temperature(temperature, scored.shape, lambda t: this_rank(t, 1)),
        return_entropy=return_entropy,
        problems=problems,
    )
    group_name = None if cp_group is None or size == 1 else cp_group.group_name
    result = layout.gather_to_positions(result, positions, group_name, -1)[..., : scored.shape[-1]]
    return split_entropy(checked(result))
