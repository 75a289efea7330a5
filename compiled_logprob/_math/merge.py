"""Every rank's statistics merged into the full vocabulary's: an all-gather of per-row
statistics, an all-reduce of exact fixed-point tile sums (``tiles``), then per-row
arithmetic. Only per-row statistics cross ranks, and the results are the same bits however
the vocabulary is sharded.

The all-gather carries what every rank must agree on (the target ids, a temperature
tensor's values), so every rank reaches the same verdict on the same data, for free: a
per-row ``verdict`` of problem bits, which the public layer asserts on the device (no host
sync) right away, or after the context-parallel gather, so that all CP ranks raise together
(docs/distributed.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob import _comm
from compiled_logprob._math import tiles
from compiled_logprob._math.kernels import assert_async, exact_exp, exact_log, finite_or_zero
from compiled_logprob._math.stats import LocalStats
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


def exchange_stats(
    local: LocalStats,
    target: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    topk: int = 0,
) -> Stats:
    """Every rank's :class:`LocalStats` merged into :class:`Stats`: of ``target``
    ``[B, S, K]`` (0 where ignored; ``K = 0`` without a target), or with ``topk`` of the
    global top ``topk``.

    Two collectives: an all-gather of the per-row statistics ``local.rows`` ``[B, S, F]``
    with the :func:`agreed_columns` of ``target`` and ``temperature`` appended, which gives
    the global max; then an all-reduce of
    the tiles' sums rescaled to it, as exact fixed-point integers (``tiles``), so that the
    totals are the same bits whatever the sharding. The verdict flags rows whose
    non-ignored targets are not owned by exactly one rank, and rows where ranks disagree
    on them.
    """
    rows = torch.cat([local.rows, *agreed_columns(target, temperature)], dim=-1)
    gathered = _comm.gather_ranks(rows, group_name)
    top = gathered[..., 0].amax(0)  # [B, S] the global max, NaN if any logit is
    shift = finite_or_zero(top)
    inverse_t = torch.ones_like(top) if temperature is None else 1.0 / temperature
    log_norm, entropy = _normalisers(local.tiles, top, shift, inverse_t, group_name, with_entropy)

    def shifted(logits: torch.Tensor) -> torch.Tensor:  # [B, S, K] x -> z − shift / T
        return (logits - shift.unsqueeze(-1)) * inverse_t.unsqueeze(-1)

    first = 1
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


def _normalisers(
    per_tile: torch.Tensor,
    top: torch.Tensor,
    shift: torch.Tensor,
    inverse_t: torch.Tensor,
    group_name: str | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_norm, entropy)`` ``[B, S]`` of every rank's tiles ``[B, S, T, P]``
    (:mod:`tiles`' order): each tile's ``Σ exp(u)`` (and ``Σ u · exp(u)``) rescaled to the
    global max ``top`` (``shift`` where finite), summed exactly over tiles and ranks.

    With ``c = (shift − x_max) / T ≥ 0`` a tile's terms are ``e^-c · Σ exp(u)`` and
    ``e^-c · (Σ u · exp(u) − c · Σ exp(u))`` (``≤ 0``), so that ``entropy = log Σ − Σ' / Σ``
    adds two non-negative terms and nothing cancels. A +inf max gives ``inf`` and a NaN
    one NaN; an all ``-inf`` row has ``Σ = 0``: log-normaliser ``-inf``, entropy 0.
    """
    tile_max, tile_sum = per_tile[..., 0], per_tile[..., 1]
    offset = (tile_max - shift.unsqueeze(-1)) * inverse_t.unsqueeze(-1)  # -c <= 0
    factor = exact_exp(offset)
    # A tile of -inf only (offset -inf, sum 0) adds 0, as its factor says.
    sums = [torch.where(factor == 0, 0.0, tile_sum * factor)]
    if with_entropy:
        weighted = (per_tile[..., 2] + offset * tile_sum) * factor
        sums.append(torch.where(factor == 0, 0.0, weighted))
    finite = top.isfinite().unsqueeze(-1)
    exact = torch.stack([tiles.fixed_point(torch.where(finite, s, 0.0)) for s in sums], -1)
    totals = tiles.from_fixed_point(_comm.all_reduce_sum(exact, group_name))
    total = totals[..., 0]
    # A +inf or NaN max leaves the totals undefined (their terms were zeroed above).
    defined = top.isfinite() | (top == -torch.inf)
    log_total = exact_log(total)
    log_norm = torch.where(defined, log_total, torch.where(top.isnan(), torch.nan, torch.inf))
    if not with_entropy:
        return log_norm.float(), torch.zeros_like(log_norm, dtype=torch.float32)
    entropy = torch.where(total == 0, 0.0, log_total - totals[..., 1] / total)
    entropy = torch.where(defined, entropy, torch.nan)
    return log_norm.float(), entropy.float()


