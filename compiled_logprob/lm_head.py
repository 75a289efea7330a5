"""Token log-probs (and entropy) straight from hidden states: the logits never exist.

At 150k–250k vocabularies the ``[B, S, V]`` logits and their gradient dominate memory.
:func:`lm_head_token_logprobs` takes the hidden states and this rank's slice of the LM-head
weight instead, and walks the sequence in chunks: per chunk it computes the logits tile,
reduces it to per-row statistics and drops it; backward recomputes each tile and
accumulates the gradients of the hidden states and the weight. No ``[B, S, V_local]``
tensor exists in forward or backward; temporaries are ``O(B · chunk · V_local)``.
:mod:`compiled_logprob.lm_head_context_parallel` does the same for context-parallel (and
packed) hidden states; :mod:`compiled_logprob.lm_head_distillation` the distillation
cross-entropy of two models' hidden states.

Every entry point takes the options that only hidden states have: ``sequence_parallel``
(Megatron's sequence-parallel hidden states, gathered over the TP group inside) and
``logits_dtype`` (an fp32 LM head's logits from bf16/fp16 operands).

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``H`` hidden size,
``V`` the full vocabulary, ``V_local`` this rank's vocabulary slice
``[vocab_start, vocab_start + V_local)``.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, _comm, _scoring, _validation, context_parallel
from compiled_logprob._math import merge
from compiled_logprob._ops.lm_head import lm_head_stats_of
from compiled_logprob._ops.lm_head_filtered import lm_head_filtered_stats_of
from compiled_logprob._validation import Head, Options, head_options

__all__ = ["lm_head_token_logprobs", "lm_head_topk"]


def check_hidden(hidden, weight, name: str = "hidden", weight_name: str = "weight") -> None:
    """``hidden`` ``[..., S, H]`` and this rank's LM-head slice ``weight`` ``[V_local, H]``."""
    for label, tensor in ((name, hidden), (weight_name, weight)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(tensor).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got dtype {hidden.dtype}; pass the "
            "model's final hidden states"
        )
    if hidden.dim() < 2:
        raise ValueError(f"{name} must have shape [..., S, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{weight_name} must be this rank's LM-head slice [V_local, H] with H = "
            f"{hidden.shape[-1]} ({name} {tuple(hidden.shape)}), got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(
            f"this rank's vocabulary shard is empty ({weight_name} shape {tuple(weight.shape)}): "
            "shard a vocabulary over at most V ranks"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"{weight_name} ({weight.dtype}, {weight.device}) and {name} ({hidden.dtype}, "
            f"{hidden.device}) must share dtype and device; cast one to the other"
        )


def positions(hidden: torch.Tensor, group: dist.ProcessGroup | None, head: Head) -> torch.Size:
    """The leading shape ``[..., S]`` of the whole sequence's hidden states: ``hidden``'s, or
    with ``sequence_parallel`` its ``S / TP`` positions times the size of ``group``."""
    size = _comm.size_rank(group)[0]
    if not head.sequence_parallel or size == 1:
        return hidden.shape[:-1]
    return torch.Size([*hidden.shape[:-2], hidden.shape[-2] * size])


def whole_sequence(hidden: torch.Tensor, options: Options, head: Head) -> torch.Tensor:
    """The whole sequence's hidden states ``[..., S, H]``: with ``sequence_parallel``, every
    TP rank's ``[..., S / TP, H]`` gathered in rank order (one all-gather; its backward
    reduce-scatters the gradient, which then sums every rank's vocabulary slice's part)."""
    if not head.sequence_parallel or options.group_name is None:
        return hidden
    return _comm.all_gather(hidden.movedim(-2, 0), options.group_name).movedim(0, -2)


def _check_target(
    leading: torch.Size, device: torch.device, target: torch.Tensor, ignore_index: object
) -> None:
    _validation.check_token_ids(target, "target")
    k_ids = target.dim() == len(leading) + 1 and target.shape[:-1] == leading
    if not (target.shape == leading or k_ids) or target.device != device:
        raise ValueError(
            f"target ({tuple(target.shape)} on {target.device}) must have the hidden states' "
            f"leading shape {tuple(leading)} (the whole sequence's, with sequence_parallel), or "
            f"that + (K,) for K ids per position, and device {device}"
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
    top_k: int | None = ...,
    top_p: float = ...,
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
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
    top_k: int | None = ...,
    top_p: float = ...,
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
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
    top_k: int | None = ...,
    top_p: float = ...,
    sequence_parallel: bool = ...,
    logits_dtype: torch.dtype | None = ...,
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
    top_k: int | None = None,
    top_p: float = 1.0,
    sequence_parallel: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, computed from the hidden states and LM-head weight.

    Eager equivalent: ``token_logprobs(hidden @ weight.T / temperature, target, ...)``, i.e.
    ``log_softmax((hidden @ full_weight.T).float() / temperature, -1).gather(-1, target[..., None])[..., 0]``
    where ``full_weight`` is the concatenation of every rank's slice along the vocabulary —
    without ever materialising the logits.

    Args:
        hidden: ``[..., S, H]``, any floating dtype, the same on every rank of ``group``
            (the replicated input of the vocab-parallel LM head); with ``sequence_parallel``,
            this rank's ``[..., S / TP, H]``.
        weight: ``[V_local, H]``, this rank's vocabulary slice of the LM-head weight, in
            ``hidden``'s dtype. The matmul runs in ``logits_dtype``; all later math in fp32.
        target: ``[..., S]`` global token ids (integer dtype), or ``[..., S, K]`` for the
            log-probs of ``K`` ids per position (distillation).
        vocab_start: first global vocabulary id of this rank's slice.
        group: the vocab-parallel (tensor-parallel) group; ``None`` or a group of size 1 means
            the vocabulary is not sharded.
        chunk_size: positions per chunk, each formed in blocks of the vocabulary of about
            ``2**24`` entries (a 64 MiB fp32 tile; at least ``B · chunk_size · 1024``).
            Default: every position, up to ``2**24 / (B · 1024)``. With ``top_k``/``top_p``
            the forward needs whole rows: ``B · chunk_size · V_local`` entries, by default
            ``2**24 / (B · V_local)`` positions.
        ignore_index: targets equal to it get log-prob (and entropy) 0 and no gradient.
        temperature: the softmax is over ``logits / temperature``: a float, or a tensor
            that broadcasts to ``[..., S]`` (e.g. ``[..., 1]``, one per row), as in
            :func:`~compiled_logprob.token_logprobs`.
        return_entropy: also return the entropy of the full-vocabulary softmax per position.
        top_k, top_p: score under a sampler's filtered distribution, as in
            :func:`~compiled_logprob.token_logprobs` (an even split in rank order, no
            ``return_entropy``); each chunk's logits tile is filtered on its own, one
            all-to-all of the tile and one all-gather of statistics per chunk.
        sequence_parallel: ``hidden`` is this rank's contiguous ``1 / TP`` of the sequence
            (Megatron's sequence parallelism, batch-first); it is all-gathered over
            ``group`` inside, and the gradient reduce-scattered back to ``[..., S / TP, H]``.
            ``target`` and the results cover the whole sequence on every rank.
        logits_dtype: ``None`` (the inputs' dtype) or ``torch.float32``: each tile's logits
            accumulated and kept in fp32 from bf16/fp16 ``hidden`` and ``weight``, as an fp32
            LM head computes them (an inference engine's); so are the backward's matmuls.

    Returns:
        fp32 log-probs of ``target``'s shape, or ``(logprobs, entropy)`` with
        ``return_entropy`` (entropy ``[..., S]``);
        differentiable with respect to ``hidden`` and ``weight``. The backward pass
        all-reduces the hidden states' gradient over ``group`` (each rank's part covers only
        its vocabulary slice), so ``hidden`` must not pass through another such reduction.

    A target that is not in ``[0, V)`` (and not ``ignore_index``) raises an error, detected on
    the device without a host sync (``torch._assert_async``).
    """
    check_hidden(hidden, weight)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )
    head = head_options(hidden, sequence_parallel, logits_dtype)
    _check_target(positions(hidden, group, head), hidden.device, target, ignore_index)
    filtering = _validation.filter_options(
        top_k, top_p, weight.shape[0], opts, group, return_entropy
    )
    hidden = whole_sequence(hidden, opts, head)
    return _scoring.finish(
        _lm_head_logprobs(hidden, weight, target, opts, head, temperature, return_entropy, filtering)
    )


def _lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    options: Options,
    head: Head,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    filtering: tuple[int, float] | None,
) -> _scoring.Scored:
    """:func:`lm_head_token_logprobs` of validated arguments and the whole sequence's
    ``hidden``, its verdict not yet checked."""
    per_position = target.dim() == hidden.dim() - 1
    ids = _validation.as_batch(target.unsqueeze(-1) if per_position else target, 2)
    rows = _validation.temperature_rows(
        temperature, hidden.shape[:-1], hidden.device, "hidden states"
    )
    batched = _validation.as_batch(hidden, 2)
    if filtering is not None:
        top_k, top_p = filtering
        filtered = lm_head_filtered_stats_of(
            batched, weight, ids, rows, **options._asdict(), **head._asdict(), top_k=top_k,
            top_p=top_p,
        )
        logprobs = _scoring.filtered_logprobs(filtered, ids, options.ignore_index)
        return _scoring.Scored(logprobs.view(target.shape), None, filtered.verdict.view(hidden.shape[:-1]))
    stats = lm_head_stats_of(
        batched, weight, ids, rows, **options._asdict(), **head._asdict(),
        with_entropy=return_entropy, topk=0,
    )
    return _scoring.logprob_outputs(stats, target, per_position, options.ignore_index, return_entropy)


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
    sequence_parallel: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens and their log-probs, from the hidden states and LM-head weight.

    Eager equivalent: ``vocab_parallel_topk(hidden @ weight.T, k, ...)``, i.e.
    ``log_softmax((hidden @ full_weight.T).float() / temperature, -1).topk(k)`` — without ever
    materialising the logits (a distillation teacher's top-k over a large vocabulary).

    Args:
        hidden, weight, vocab_start, group, chunk_size, temperature, sequence_parallel,
            logits_dtype: as in :func:`lm_head_token_logprobs`.
        k: how many; at most ``V_local`` on every rank (with uneven shards, the smallest).

    Returns:
        ``(logprobs, ids)``, both ``[..., S, k]`` (the whole sequence's): fp32 log-probs,
        differentiable with respect to ``hidden`` and ``weight`` (the backward as in
        :func:`lm_head_token_logprobs`), and int64 global vocabulary ids, sorted by
        decreasing probability. Each chunk's top ``k`` comes from its logits tile in the
        statistics pass (block maxima, as in :func:`~compiled_logprob.vocab_parallel_topk`),
        and the one all-gather of statistics carries every rank's.
    """
    check_hidden(hidden, weight)
    opts = _validation.options(vocab_start=vocab_start, group=group, chunk_size=chunk_size)
    head = head_options(hidden, sequence_parallel, logits_dtype)
    k = _validation.check_topk(k, opts.vocab_start, weight.shape[0])
    hidden = whole_sequence(hidden, opts, head)
    leading = hidden.shape[:-1]
    stats = lm_head_stats_of(
        _validation.as_batch(hidden, 2),
        weight,
        None,
        _validation.temperature_rows(temperature, leading, hidden.device, "hidden states"),
        **opts._asdict(),
        **head._asdict(),
        with_entropy=False,
        topk=k,
    )
    merge.assert_verdict(stats.verdict)
    logprobs = stats.target_logit - stats.log_norm.unsqueeze(-1)
    return logprobs.view(*leading, k), stats.topk_ids.view(*leading, k)


def hidden_local_fn(
    hidden, weight, input_ids, *, vocab_start, group, chunk_size, ignore_index, top_k, top_p,
    return_entropy, sequence_parallel, logits_dtype,
):
    """``(local_fn, hidden)``: the local log-probs of validated hidden states,
    ``local_fn(target, *, temperature, return_entropy)``, the ``local_fn`` of the
    context-parallel entry points, and this CP rank's whole hidden states (gathered over TP
    with ``sequence_parallel``)."""
    check_hidden(hidden, weight)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )
    head = head_options(hidden, sequence_parallel, logits_dtype)
    context_parallel.check_ids(hidden, input_ids, "hidden states")
    _validation.check_ignore_index(ignore_index, input_ids)
    filtering = _validation.filter_options(top_k, top_p, weight.shape[0], opts, group, return_entropy)
    hidden = whole_sequence(hidden, opts, head)

    def local_fn(target, *, temperature, return_entropy):
        return _lm_head_logprobs(
            hidden, weight, target, opts, head, temperature, return_entropy, filtering
        )

    return local_fn, hidden
