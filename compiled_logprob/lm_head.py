"""Token log-probs (and entropy) straight from hidden states: the logits never exist.

At 150k–250k vocabularies the ``[B, S, V]`` logits and their gradient dominate memory.
:func:`lm_head_token_logprobs` takes the hidden states and this rank's slice of the LM-head
weight instead, and walks the sequence in chunks: per chunk it computes the logits tile,
reduces it to per-row statistics and drops it; backward recomputes each tile and
accumulates the gradients of the hidden states and the weight. No ``[B, S, V_local]``
tensor exists in forward or backward; temporaries are ``O(B · chunk · V_local)``.
:mod:`compiled_logprob.lm_head_context_parallel` does the same for context-parallel (and
packed) hidden states.

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``H`` hidden size,
``V`` the full vocabulary, ``V_local`` this rank's vocabulary slice
``[vocab_start, vocab_start + V_local)``.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, _validation, context_parallel
from compiled_logprob import logits as _logits
from compiled_logprob._math import merge
from compiled_logprob._ops.lm_head import lm_head_stats_of
from compiled_logprob._validation import Options

__all__ = ["lm_head_token_logprobs", "lm_head_topk"]


def _validate_hidden(hidden, weight) -> None:
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(
            f"hidden must be a floating-point tensor, got dtype {hidden.dtype}; pass the "
            "model's final hidden states"
        )
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape [..., S, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be this rank's LM-head slice [V_local, H] with H = {hidden.shape[-1]} "
            f"(hidden {tuple(hidden.shape)}), got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(
            f"this rank's vocabulary shard is empty (weight shape {tuple(weight.shape)}): shard a "
            "vocabulary over at most V ranks"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, "
            f"{hidden.device}) must share dtype and device; cast one to the other"
        )


def _check_target(hidden: torch.Tensor, target: torch.Tensor, ignore_index: object) -> None:
    _validation.check_token_ids(target, "target")
    positions = hidden.shape[:-1]
    k_ids = target.dim() == hidden.dim() and target.shape[:-1] == positions
    if not (target.shape == positions or k_ids) or target.device != hidden.device:
        raise ValueError(
            f"target ({tuple(target.shape)} on {target.device}) must have the hidden states' "
            f"leading shape {tuple(positions)}, or that + (K,) for K ids per position, and "
            f"device {hidden.device}"
        )
    _validation.check_ignore_index(ignore_index, target)


@overload
def lm_head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def lm_head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def lm_head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = ...,
    group: dist.ProcessGroup | None = ...,
    chunk_size: int | None = ...,
    ignore_index: int | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@_agreement.agreed
def lm_head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, computed from the hidden states and LM-head weight.

    Eager equivalent: ``token_logprobs(hidden @ weight.T / temperature, target, ...)``, i.e.
    ``log_softmax((hidden @ full_weight.T).float() / temperature, -1).gather(-1, target[..., None])[..., 0]``
    where ``full_weight`` is the concatenation of every rank's slice along the vocabulary —
    without ever materialising the logits.

    Args:
        hidden: ``[..., S, H]``, any floating dtype, the same on every rank of ``group``
            (the replicated input of the vocab-parallel LM head).
        weight: ``[V_local, H]``, this rank's vocabulary slice of the LM-head weight, in
            ``hidden``'s dtype. The matmul runs in that dtype; all later math in fp32.
        target: ``[..., S]`` global token ids (integer dtype), or ``[..., S, K]`` for the
            log-probs of ``K`` ids per position (distillation).
        vocab_start: first global vocabulary id of this rank's slice.
        group: the vocab-parallel (tensor-parallel) group; ``None`` or a group of size 1 means
            the vocabulary is not sharded.
        chunk_size: positions per chunk; temporaries are ``O(B · chunk_size · V_local)``
            fp32. Default: about ``2**24 / (B · V_local)`` positions (a 64 MiB tile).
        ignore_index: targets equal to it get log-prob (and entropy) 0 and no gradient.
        temperature: the softmax is over ``logits / temperature``: a float, or a tensor
            that broadcasts to ``[..., S]`` (e.g. ``[..., 1]``, one per row), as in
            :func:`~compiled_logprob.token_logprobs`.
        return_entropy: also return the entropy of the full-vocabulary softmax per position.

    Returns:
        fp32 log-probs of ``target``'s shape, or ``(logprobs, entropy)`` with
        ``return_entropy`` (entropy ``[..., S]``);
        differentiable with respect to ``hidden`` and ``weight``. The backward pass
        all-reduces the hidden states' gradient over ``group`` (each rank's part covers only
        its vocabulary slice), so ``hidden`` must not pass through another such reduction.

    A target that is not in ``[0, V)`` (and not ``ignore_index``) raises an error, detected on
    the device without a host sync (``torch._assert_async``).
    """
    _validate_hidden(hidden, weight)
    _check_target(hidden, target, ignore_index)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )
    return _logits.finish(_lm_head_logprobs(hidden, weight, target, opts, temperature, return_entropy))


def _lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: Options,
    temperature: float | torch.Tensor,
    return_entropy: bool,
) -> _logits.Scored:
    """:func:`lm_head_token_logprobs` of validated arguments, its verdict not yet checked."""
    per_position = target.dim() == hidden.dim() - 1
    ids = target.unsqueeze(-1) if per_position else target  # [..., S, K]
    stats = lm_head_stats_of(
        _validation.as_batch(hidden, 2),
        weight,
        _validation.as_batch(ids, 2),
        _validation.temperature_rows(temperature, hidden.shape[:-1], hidden.device, "hidden states"),
        **options._asdict(),
        with_entropy=return_entropy,
        topk=0,
    )
    return _logits.logprob_outputs(stats, target, per_position, options.ignore_index, return_entropy)


@_agreement.agreed
def lm_head_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens and their log-probs, from the hidden states and LM-head weight.

    Eager equivalent: ``vocab_parallel_topk(hidden @ weight.T, k, ...)``, i.e.
    ``log_softmax((hidden @ full_weight.T).float() / temperature, -1).topk(k)`` — without ever
    materialising the logits (a distillation teacher's top-k over a large vocabulary).

    Args:
        hidden, weight, vocab_start, group, chunk_size, temperature: as in
            :func:`lm_head_token_logprobs`.
        k: how many; at most ``V_local`` on every rank (with uneven shards, the smallest).

    Returns:
        ``(logprobs, ids)``, both ``[..., S, k]``: fp32 log-probs, differentiable with respect
        to ``hidden`` and ``weight`` (the backward as in :func:`lm_head_token_logprobs`), and
        int64 global vocabulary ids, sorted by decreasing probability. Each chunk's top ``k``
        comes from its logits tile in the statistics pass (block maxima, as in
        :func:`~compiled_logprob.vocab_parallel_topk`), and the one all-gather of statistics
        carries every rank's.
    """
    _validate_hidden(hidden, weight)
    opts = _validation.options(vocab_start=vocab_start, group=group, chunk_size=chunk_size)
    k = _validation.check_topk(k, opts.vocab_start, weight.shape[0])
    positions = hidden.shape[:-1]
    stats = lm_head_stats_of(
        _validation.as_batch(hidden, 2),
        weight,
        None,
        _validation.temperature_rows(temperature, positions, hidden.device, "hidden states"),
        **opts._asdict(),
        with_entropy=False,
        topk=k,
    )
    merge.assert_verdict(stats.verdict)
    logprobs = stats.target_logit - stats.log_norm.unsqueeze(-1)
    return logprobs.view(*positions, k), stats.topk_ids.view(*positions, k)


def hidden_local_fn(
    hidden, weight, input_ids, *, vocab_start, group, chunk_size, ignore_index
):
    """The local log-probs of validated hidden states: ``fn(target, *, temperature,
    return_entropy)``, the ``local_fn`` of the context-parallel entry points."""
    _validate_hidden(hidden, weight)
    context_parallel.check_ids(hidden, input_ids, "hidden states")
    _validation.check_ignore_index(ignore_index, input_ids)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )

    def local_fn(target, *, temperature, return_entropy):
        return _lm_head_logprobs(hidden, weight, target, opts, temperature, return_entropy)

    return local_fn
