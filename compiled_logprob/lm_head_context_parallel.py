"""Next-token log-probs from TP×CP-sharded hidden states, plain and packed: the
context-parallel entry points' target shift, layouts and gather
(:mod:`compiled_logprob.context_parallel`, :mod:`compiled_logprob.packed`) over the local
log-probs of :mod:`compiled_logprob.lm_head`, the logits never materialised.

Shape legend: ``B`` batch, ``S`` full sequence, ``L`` this CP rank's part of it, ``T``
tokens of a packed row, ``C`` CP ranks, ``H`` hidden size, ``V_local`` this rank's
vocabulary slice.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, context_parallel, lm_head, packed

__all__ = ["lm_head_context_parallel_logprobs", "lm_head_packed_context_parallel_logprobs"]


@overload
def lm_head_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> torch.Tensor: ...


@overload
def lm_head_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def lm_head_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@_agreement.agreed
def lm_head_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs from TP×CP-sharded hidden states, fp32 ``[..., S - 1]`` in natural order.

    Eager equivalent: ``context_parallel_logprobs(hidden @ weight.T, input_ids, ...)`` without
    ever materialising the ``[..., L, V_local]`` logits.

    Args:
        hidden: ``[..., L, H]``, this rank's part of the sequence's hidden states, laid out
            exactly like the logits of :func:`~compiled_logprob.context_parallel_logprobs`
            (the load-balanced CP shard, or ``seq_index``'s layout) and the same on every
            rank of ``group``.
        weight: ``[V_local, H]``, this rank's vocabulary slice of the LM-head weight, in
            ``hidden``'s dtype.
        input_ids: ``[..., S]`` the full, unshifted token ids in natural order, ``S <= C * L``.
        vocab_start, group, cp_group, seq_index, ignore_index, temperature, return_entropy,
            next_token: as in :func:`~compiled_logprob.context_parallel_logprobs` (a tensor
            ``temperature`` broadcasts to the output).
        top_k, top_p: as in :func:`~compiled_logprob.context_parallel_logprobs`.
        chunk_size, sequence_parallel, logits_dtype: as in :func:`lm_head_token_logprobs`
            (with ``sequence_parallel``, ``hidden`` is this rank's ``[..., L / TP, H]``).

    Backward: the hidden states' gradient is all-reduced over ``group`` (as in
    :func:`lm_head_token_logprobs`) and, like the logits', is the sum over CP ranks of the
    upstream gradients at this rank's positions; ``weight`` receives this rank's positions'
    contribution only.
    """
    local_fn, hidden = lm_head.hidden_local_fn(
        hidden, weight, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
        sequence_parallel=sequence_parallel, logits_dtype=logits_dtype,
    )
    return context_parallel.cp_logprobs(
        local_fn,
        hidden,
        input_ids,
        cp_group=cp_group,
        seq_index=seq_index,
        temperature=temperature,
        return_entropy=return_entropy,
        next_token=next_token,
        name="hidden states",
    )


@overload
def lm_head_packed_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> torch.Tensor: ...


@overload
def lm_head_packed_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def lm_head_packed_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@_agreement.agreed
def lm_head_packed_context_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    sequence_parallel: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of a packed (THD) row from TP×CP-sharded hidden states, fp32 ``[B, max_seqlen - 1]``.

    Eager equivalent: ``packed_context_parallel_logprobs(hidden @ weight.T, input_ids,
    cu_seqlens_padded, max_seqlen=max_seqlen, ...)`` without ever materialising the logits.

    Args:
        hidden: ``[1, T / C, H]``, laid out like the logits of
            :func:`~compiled_logprob.packed_context_parallel_logprobs` (every padded sequence
            load-balanced-sharded on its own), the same on every rank of ``group``.
        weight: ``[V_local, H]``, this rank's vocabulary slice of the LM-head weight.
        input_ids, cu_seqlens_padded, max_seqlen, vocab_start, group, cp_group, ignore_index,
            temperature, return_entropy, next_token: as in
            :func:`~compiled_logprob.packed_context_parallel_logprobs` (a tensor
            ``temperature`` broadcasts to the output ``[B, max_seqlen - 1]``).
        top_k, top_p: as in :func:`~compiled_logprob.packed_context_parallel_logprobs`.
        chunk_size, sequence_parallel, logits_dtype: as in :func:`lm_head_token_logprobs`
            (with ``sequence_parallel``, ``hidden`` is this rank's ``[1, T / C / TP, H]``).

    Gradients as in :func:`lm_head_context_parallel_logprobs`.
    """
    local_fn, hidden = lm_head.hidden_local_fn(
        hidden, weight, input_ids, vocab_start=vocab_start, group=group, chunk_size=chunk_size,
        ignore_index=ignore_index, top_k=top_k, top_p=top_p, return_entropy=return_entropy,
        sequence_parallel=sequence_parallel, logits_dtype=logits_dtype,
    )
    return packed.packed_cp_logprobs(
        local_fn,
        hidden,
        input_ids,
        cu_seqlens_padded,
        max_seqlen=max_seqlen,
        cp_group=cp_group,
        temperature=temperature,
        return_entropy=return_entropy,
        next_token=next_token,
        name="hidden states",
    )
