"""Every rank's statistics merged into the full vocabulary's: the one all-gather per call,
then per-row arithmetic. Only per-row statistics cross ranks.

The same all-gather carries what every rank must agree on (the target ids, a temperature
tensor's values), so every rank reaches the same verdict on the same data, for free: a
per-row ``verdict`` of problem bits, which the public layer asserts on the device (no host
sync) right away, or after the context-parallel gather, so that all CP ranks raise together
(docs/distributed.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob import _comm
from compiled_logprob._math.kernels import assert_async, finite_or_zero
from compiled_logprob._math.topk import merge_topk

OWNERSHIP_ERROR = (
    "compiled_logprob: a target id is not owned by exactly one vocabulary shard (negative, "
    ">= the vocabulary size, or [vocab_start, vocab_end) ranges that overlap or leave a gap). "
    "Mask it (ignore_index=... gives log-prob 0) or fix the shard bounds."
)
# The verdict's problem bits, and what each says on every rank.
NOT_OWNED, IDS_DIFFER, TEMPERATURES_DIFFER, BAD_PACKING, BAD_SEQ_INDEX = 1, 2, 4, 8, 16
# Checked in this order: a malformed packing or ids that differ make targets unowned too.
PROBLEMS = {
    BAD_SEQ_INDEX: (
        "compiled_logprob: seq_index must be a permutation of 0 .. CP size x local length - 1 "
        "(each natural position exactly once), the same on every CP rank"
    ),
    BAD_PACKING: (
        "compiled_logprob: cu_seqlens_padded must start at 0, never decrease, end at T (the "
        "packed row's length) and, under CP, hold multiples of 2 * cp_size, on every CP rank"
    ),
    IDS_DIFFER: (
        "compiled_logprob: the ranks of the vocab-parallel group hold different target ids for "
        "the same positions: every rank of the group must pass the same target (or input_ids)"
    ),
    TEMPERATURES_DIFFER: (
        "compiled_logprob: the ranks of the vocab-parallel group hold different temperatures "
        "for the same positions: every rank of the group must pass the same temperature"
    ),
    NOT_OWNED: OWNERSHIP_ERROR,
}


def agreed_columns(target: torch.Tensor | None, temperature: torch.Tensor | None) -> list[torch.Tensor]:
    """The columns that travel with a shard's statistics for every rank to compare: the
    target ids ``[B, S, K]`` (as fp32: exact below 2**24, and any id beyond that is owned by
    no rank) and a temperature ``[B, S, 1]``."""
    columns = [] if target is None else [target.float()]
    return columns if temperature is None else [*columns, temperature.unsqueeze(-1)]


def differ(gathered: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: where any rank's ``[R, B, S, n]`` columns differ from rank 0's."""
    return (gathered != gathered[:1]).any(0).any(-1)


_BITS = {
    "not_owned": NOT_OWNED,
    "ids_differ": IDS_DIFFER,
    "temperatures_differ": TEMPERATURES_DIFFER,
    "bad_packing": BAD_PACKING,
    "bad_seq_index": BAD_SEQ_INDEX,
}


def verdict_of(like: torch.Tensor, **problems: torch.Tensor | None) -> torch.Tensor:
    """The verdict, fp32 of ``like``'s shape (``[B, S]`` per row, or a scalar for a whole
    call): the sum of the bits of ``problems`` (bool tensors that broadcast to it, or
    ``None``), named as in :data:`PROBLEMS` (``not_owned=...``); 0 where none is set."""
    verdict = torch.zeros_like(like, dtype=torch.float32)
    for name, problem in problems.items():
        if problem is not None:
            verdict = verdict + problem.float() * _BITS[name]
    return verdict


def assert_verdict(verdict: torch.Tensor) -> None:
    """Raise, on the device (no host sync), the error of each problem bit set anywhere in
    ``verdict``: every rank that holds the same verdict raises the same error."""
    bits = verdict.to(torch.int32)
    for bit, message in PROBLEMS.items():
        assert_async(((bits & bit) == 0).all(), message)


class Stats(NamedTuple):
    """The full vocabulary's per-row statistics, fp32 unless said.

    ``lse = shift / T + log_norm`` and a log-prob is ``target_logit − log_norm``, each term
    rounded once, however large the logits are.
    """

    shift: torch.Tensor  # [B, S] the row's max logit, unscaled (0 where infinite); constant
    log_norm: torch.Tensor  # [B, S] log Σ exp(z − shift / T), the softmax's log-normaliser
    target_logit: torch.Tensor  # [B, S, K] z − shift / T at the targets (or the top-k)
    entropy: torch.Tensor  # [B, S] the entropy (0 unless asked for)
    topk_ids: torch.Tensor  # [B, S, k] int64 global ids of the top-k (k = 0 without)
    verdict: torch.Tensor  # [B, S] problem bits (PROBLEMS), the same on every rank; constant


def empty_stats(rows: torch.Tensor, target: torch.Tensor | None, topk: int) -> Stats:
    """Uninitialised :class:`Stats` for the positions ``rows.shape[:-1]`` ``[B, S]``, of
    ``target`` ``[B, S, K]`` or the top ``topk``: the ops' fake kernels."""
    row = rows.new_empty(rows.shape[:-1], dtype=torch.float32)
    k = topk if target is None else target.shape[-1]
    return Stats(
        row,
        torch.empty_like(row),
        rows.new_empty(*rows.shape[:-1], k, dtype=torch.float32),
        torch.empty_like(row),
        rows.new_empty(*rows.shape[:-1], topk, dtype=torch.int64),
        torch.empty_like(row),
    )


def common_shift(
    row_max: torch.Tensor, sum_exp: torch.Tensor, inverse_t: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, shard_mass, factor)`` of every rank's row max and ``Σ exp(z − its max)``
    ``[R, B, S]``: the common ``shift`` (the global max, 0 where infinite), each shard's sum
    rescaled to it, and the rescaling ``factor``. A -inf shard's factor is exp(-inf) = 0,
    whatever the shift it summed with."""
    shift = finite_or_zero(row_max.amax(0))
    factor = torch.exp((row_max - shift) * inverse_t)
    return shift, sum_exp * factor, factor


def mixture_entropy(log_weights: torch.Tensor, entropies: torch.Tensor, dim: int) -> torch.Tensor:
    """Entropy ``Σ_i w_i · (H_i − log w_i)`` of a mixture of disjoint distributions with
    weights ``w = exp(log_weights)`` (summing to 1 along ``dim``) and entropies ``H``.

    Every term is non-negative, so nothing cancels: the error stays a few ulps of the
    logits, where ``lse − E[z]`` would lose ulps of ``|z|`` times ``|z|``. A component of
    weight 0 contributes 0, even when its ``log w`` is ``-inf`` or NaN (a whole -inf shard);
    a NaN weight (a NaN logit) makes the entropy NaN.
    """
    weights = torch.exp(log_weights)
    return torch.where(weights == 0, 0.0, weights * (entropies - log_weights)).sum(dim)


def exchange_stats(
    stats: torch.Tensor,
    target: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    topk: int = 0,
) -> Stats:
    """All-gather this shard's statistics ``[B, S, F]`` (the one collective) and merge every
    rank's into :class:`Stats`: of ``target`` ``[B, S, K]`` (0 where ignored; ``K = 0``
    without a target), or with ``topk`` of the global top ``topk``.

    ``stats`` ends with :func:`agreed_columns`; the verdict flags rows whose non-ignored
    targets are not owned by exactly one rank, and rows where ranks disagree on them.
    """
    gathered = _comm.gather_ranks(stats, group_name)
    row_max, sum_exp = gathered[..., 0], gathered[..., 1]
    inverse_t = torch.ones_like(row_max[0]) if temperature is None else 1.0 / temperature
    shift, shard_mass, _ = common_shift(row_max, sum_exp, inverse_t)
    total = shard_mass.sum(0)
    log_norm = torch.log(total)
    if with_entropy:
        # The full softmax is the mixture of the shards' softmaxes, with weights
        # shard_mass / total; a shard's entropy is log Σe − Σe·c / Σe (c = z − max ≤ 0).
        shard_entropy = torch.log(sum_exp) - gathered[..., 2] / sum_exp
        log_weights = torch.log(shard_mass) - log_norm
        entropy = mixture_entropy(log_weights, shard_entropy, 0)
    else:
        entropy = torch.zeros_like(log_norm)

    def shifted(logits: torch.Tensor) -> torch.Tensor:  # [B, S, K] x -> z − shift / T
        return (logits - shift.unsqueeze(-1)) * inverse_t.unsqueeze(-1)

    first = 3 if with_entropy else 2
    temperatures_differ = None if temperature is None else differ(gathered[..., -1:])
    if topk:
        candidates, ids = merge_topk(gathered[..., first : first + 2 * topk], topk)
        verdict = verdict_of(log_norm, temperatures_differ=temperatures_differ)
        return Stats(shift, log_norm, shifted(candidates), entropy, ids, verdict)
    no_ids = log_norm.new_zeros(*log_norm.shape, 0, dtype=torch.int64)
    if target is None:
        verdict = verdict_of(log_norm, temperatures_differ=temperatures_differ)
        no_targets = log_norm.new_zeros(*log_norm.shape, 0)
        return Stats(shift, log_norm, no_targets, entropy, no_ids, verdict)
    k = target.shape[-1]
    target_logit = shifted(gathered[..., first : first + k].sum(0))
    owned_once = gathered[..., first + k : first + 2 * k].sum(0) == 1
    if ignore_index is not None:
        ignored = target == ignore_index
        owned_once = owned_once | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    verdict = verdict_of(
        log_norm,
        not_owned=~owned_once.all(-1),
        ids_differ=differ(gathered[..., first + 2 * k : first + 3 * k]),
        temperatures_differ=temperatures_differ,
    )
    return Stats(shift, log_norm, target_logit, entropy, no_ids, verdict)
