"""Vocab-parallel token log-probs: the functional API.

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``V`` the full
vocabulary, ``V_local`` this rank's vocabulary slice ``[vocab_start, vocab_start + V_local)``.

Every function takes the logits of one vocabulary shard and returns values defined over the
*full* vocabulary: only per-row ``[B, S]`` statistics cross ranks (an all-gather and an
all-reduce per call, chunked or not). The backward of the per-row results (log-probs, logsumexp) communicates
nothing; only the sharded log-softmax, whose every entry depends on every shard, all-reduces
one ``[B, S]`` vector in backward. All of it traces whole under
``torch.compile(fullgraph=True)``, performs no host synchronisation (so it can be captured
in CUDA graphs) and needs no ``torch.distributed`` at all when ``group`` is ``None``.
Top-k/top-p filtering needs whole rows: it adds one all-to-all of the logits.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, _scoring, _validation
from compiled_logprob._math import merge
from compiled_logprob._ops.cross_entropy import cross_entropy_of
from compiled_logprob._ops.log_softmax import log_softmax_shard

__all__ = [
    "token_logprobs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
]


@overload
def token_logprobs(
    logits: torch.Tensor,
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
    inplace_backward: bool = ...,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    logits: torch.Tensor,
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
    inplace_backward: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(
    logits: torch.Tensor,
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
    inplace_backward: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@_agreement.agreed
def token_logprobs(
    logits: torch.Tensor,
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
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token under the softmax over the full vocabulary.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1).gather(-1, target[..., None])[..., 0]``
    where ``full_logits`` is the concatenation of every rank's shard along the vocabulary.

    Args:
        logits: ``[..., S, V_local]``, any floating dtype; the math runs in fp32.
        target: ``[..., S]`` global token ids (integer dtype), or ``[..., S, K]`` for the
            log-probs of ``K`` ids per position (distillation).
        vocab_start: first global vocabulary id of this rank's shard.
        group: the vocab-parallel (tensor-parallel) group; ``None`` or a group of size 1 means
            the vocabulary is not sharded.
        chunk_size: process at most this many positions at a time, so that no eager
            temporary exceeds ``O(B * chunk_size * V_local)`` (compiled, the fused pass keeps
            no such temporary at all). The same collectives and the same bits.
        ignore_index: targets equal to it get log-prob 0 and no gradient.
        temperature: the softmax is over ``logits / temperature``: a float, or a tensor that
            broadcasts to ``[..., S]`` (e.g. ``[..., 1]``, one per row). The scaled logits are
            never materialised.
        return_entropy: also return the entropy of the full-vocabulary distribution at each
            position, ``[..., S]``, from the same pass over the logits (differentiable).
        top_k, top_p: score under a sampler's filtered distribution (top-k, then top-p, of
            the logits over ``temperature``, as vLLM and NeMo-RL filter): the ids kept are
            those of at least the ``top_k``-th largest logit (ties kept), then of those the
            fewest most probable whose mass reaches ``top_p`` (tied ids kept or dropped
            together); the softmax is over the kept ids, and a target filtered out has
            log-prob ``-inf`` and no gradient. ``None`` and ``1.0`` filter nothing. Needs an
            even split in rank order (``vocab_start = rank * V_local``, NeMo-RL's layout),
            and not ``return_entropy``. Filtering needs whole rows: one all-to-all of the
            logits hands each rank ``1 / TP`` of the rows, whole, to filter (as NeMo-RL
            does), and one all-gather of ``[B·S / TP, 3 + K]`` statistics brings the rows'
            back (per chunk, with ``chunk_size``); backward communicates nothing.
        inplace_backward: the backward writes the logits' gradient into the logits' own
            storage and hands it on as the gradient, so that training needs no buffer of the
            logits' size (as Megatron's cross-entropy and flash-attn's do). The caller
            promises not to read the logits after the backward; anything else that saved
            them for its own backward fails loudly (autograd's version check) rather than
            reading the gradient.

    Returns:
        fp32 log-probs of ``target``'s shape, differentiable with respect to ``logits``
        (gradient in their dtype); with ``return_entropy``, ``(logprobs, entropy)``.

    A target that is not in ``[0, V)`` (and not ``ignore_index``) raises an error, detected on
    the device without a host sync (``torch._assert_async``).
    """
    _validation.check_logits(logits)
    _validation.check_target(logits, target, ignore_index)
    opts = _validation.options(
        vocab_start=vocab_start, group=group, chunk_size=chunk_size, ignore_index=ignore_index
    )
    filtering = _validation.filter_options(top_k, top_p, logits.shape[-1], opts, group, return_entropy)
    _validation.check_inplace_backward(logits, inplace_backward)
    return _scoring.finish(
        _scoring.token_logprobs_of(
            logits, target, opts, temperature, return_entropy, filtering, inplace_backward
        )
    )


def scored_token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
) -> _scoring.Scored:
    """:func:`token_logprobs` with its verdict not yet asserted, for callers that assert it
    after a context-parallel gather (:func:`compiled_logprob.context_parallel.gather_checked`),
    so that every CP rank raises together."""
    _validation.check_logits(logits)
    _validation.check_target(logits, target, None)
    opts = _validation.options(vocab_start=vocab_start, group=group)
    return _scoring.token_logprobs_of(logits, target, opts, 1.0, return_entropy)


@_agreement.agreed
def vocab_parallel_logsumexp(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Logsumexp over the full (sharded) vocabulary, fp32 ``[..., S]``, differentiable.

    Eager equivalent: ``torch.logsumexp(full_logits.float() / temperature, -1)``.
    """
    _validation.check_logits(logits)
    opts = _validation.options(group=group, chunk_size=chunk_size)
    stats = _scoring.stats(logits, None, opts, temperature)
    merge.assert_verdict(stats.verdict)
    return stats.shift / _validation.fp32_temperature(temperature) + stats.log_norm


@_agreement.agreed
def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Entropy of the full-vocabulary distribution per position, fp32 ``[..., S]``, differentiable.

    Eager equivalent: ``torch.distributions.Categorical(logits=full_logits.float() / temperature).entropy()``.
    One all-gather of ``[..., S, 1]`` statistics and one all-reduce of ``[..., S, 2]`` exact
    sums; no collective in backward.
    """
    _validation.check_logits(logits)
    opts = _validation.options(group=group, chunk_size=chunk_size)
    stats = _scoring.stats(logits, None, opts, temperature, with_entropy=True)
    merge.assert_verdict(stats.verdict)
    return stats.entropy


@_agreement.agreed
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Cross-entropy of the target logits' distribution relative to the logits', over the full
    (sharded) vocabulary, fp32 ``[..., S]``: a distillation loss (the forward KL from the
    target's distribution up to that distribution's entropy, a constant for the student).

    Eager equivalent: ``-(torch.softmax(full_target.float() / temperature, -1) * torch.log_softmax(full_logits.float() / temperature, -1)).sum(-1)``.

    Args:
        logits: ``[..., S, V_local]``, the student's logits on this rank's vocabulary slice.
        target_logits: the same shape, sharded the same way: the teacher's logits (any
            floating dtype; both are read in fp32).
        group: the vocab-parallel group; ``None`` (or size 1): the vocabulary is not sharded.
        chunk_size: sequence positions per eager block (bounds the temporaries).
        temperature: both softmaxes are of ``logits / temperature``; a float or a tensor that
            broadcasts to ``[..., S]``, as in :func:`token_logprobs`.

    Differentiable with respect to both inputs (detach ``target_logits`` for a fixed
    teacher: no gradient is computed for it then). One all-gather of ``[..., S, 5]``
    statistics; the backward is one elementwise pass per input, with no collective. The
    result stays accurate for logits ×1000 (its two parts are non-negative sums); it is
    ``inf`` where the target puts mass on a ``-inf`` logit, and NaN for a NaN logit.
    """
    _validation.check_logits(logits)
    _validation.check_logits(target_logits, "target_logits")
    if target_logits.shape != logits.shape or target_logits.device != logits.device:
        raise ValueError(
            f"target_logits ({tuple(target_logits.shape)} on {target_logits.device}) must have "
            f"the logits' shape {tuple(logits.shape)} and device {logits.device}: the same "
            "positions and vocabulary shard"
        )
    opts = _validation.options(group=group, chunk_size=chunk_size)
    rows_shape = logits.shape[:-1]
    stats = cross_entropy_of(
        _validation.as_batch(logits, 2),
        _validation.as_batch(target_logits, 2),
        _validation.temperature_rows(temperature, rows_shape, logits.device),
        group_name=opts.group_name,
        chunk_size=opts.chunk_size,
    )
    return stats.cross_entropy.view(rows_shape)


@_agreement.agreed
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens over the full (sharded) vocabulary and their log-probs.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1).topk(k)``.

    Returns ``(logprobs, ids)``, both ``[..., S, k]``: fp32 log-probs (differentiable with
    respect to ``logits``) and int64 global vocabulary ids, sorted by decreasing probability.
    Each rank finds its local top ``k`` in the statistics pass of :func:`token_logprobs`
    (the block maxima that select them also give the row max), and the one all-gather of
    statistics carries them, so that the global ones are picked after it. Beyond the
    plain pass, it keeps one temporary: the block maxima, ``[..., S, V_local / 16]`` (per
    chunk of ``chunk_size`` positions in eager). Requires ``k <= V_local`` on every rank:
    with uneven shards, ``k`` at most the smallest shard (a rank with fewer entries raises
    before the collective, which the others would then wait in).
    """
    _validation.check_logits(logits)
    opts = _validation.options(vocab_start=vocab_start, group=group, chunk_size=chunk_size)
    k = _validation.check_topk(k, opts.vocab_start, logits.shape[-1])
    stats = _scoring.stats(logits, None, opts, temperature, topk=k)
    merge.assert_verdict(stats.verdict)
    return stats.target_logit - stats.log_norm.unsqueeze(-1), stats.topk_ids


@_agreement.agreed
def vocab_parallel_log_softmax(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This shard of the log-softmax over the full vocabulary, ``[..., S, V_local]``.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1)[..., vocab_start:vocab_end].to(dtype)``.
    The result is ``dtype`` (default: the logits' dtype); ``temperature`` as in
    :func:`token_logprobs`. Unlike the token log-probs this materialises a full
    ``[..., S, V_local]`` tensor, and ``chunk_size`` bounds only the statistics pass: forward
    and backward each form fp32 temporaries of the output's size. Prefer
    :func:`token_logprobs` when only the targets' log-probs are needed. Its backward
    all-reduces one fp32 ``[..., S]`` gradient over ``group``: every rank's output depends
    on every shard.
    """
    _validation.check_logits(logits)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    opts = _validation.options(group=group, chunk_size=chunk_size)
    stats = _scoring.stats(logits.detach(), None, opts, temperature)
    merge.assert_verdict(stats.verdict)
    temperature = _validation.fp32_temperature(temperature)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.unsqueeze(-1)  # [..., S, 1]: one per row
    inverse_t = 1.0 / temperature
    return log_softmax_shard(
        logits, stats.shift, stats.log_norm, inverse_t, opts.group_name, dtype or logits.dtype
    )
