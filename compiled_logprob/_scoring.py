"""From the ops' per-row statistics to a token log-prob call's results: the log-probs, the
entropy and the verdict (:class:`Scored`), shared by every entry point that scores tokens
(the logits, the LM head, context parallelism), and :func:`finish`, which asserts the
verdict on the device before the results are handed out.

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``K`` ids per position,
``V_local`` this rank's vocabulary slice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled_logprob import _validation
from compiled_logprob._math import merge
from compiled_logprob._math.merge import Stats
from compiled_logprob._ops.filtering import FilteredStats, filtered_stats_of
from compiled_logprob._ops.stats import stats_of
from compiled_logprob._validation import Options


def stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    options: Options,
    temperature: float | torch.Tensor,
    *,
    with_entropy: bool = False,
    topk: int = 0,
    inplace_backward: bool = False,
) -> Stats:
    """The op's :class:`~compiled_logprob._math.merge.Stats` of ``target`` ``[..., S, K]``, or
    of the top ``topk`` ids when ``target`` is ``None``, in the logits' leading shape."""
    rows_shape = logits.shape[:-1]
    result = stats_of(
        _validation.as_batch(logits, 2),
        None if target is None else _validation.as_batch(target, 2),
        _validation.temperature_rows(temperature, rows_shape, logits.device),
        **options._asdict(),
        with_entropy=with_entropy,
        topk=topk,
        inplace_backward=inplace_backward,
    )
    return Stats(
        result.shift.view(rows_shape),
        result.log_norm.view(rows_shape),
        result.target_logit.view(*rows_shape, result.target_logit.shape[-1]),
        result.entropy.view(rows_shape),
        result.topk_ids.view(*rows_shape, topk),
        result.verdict.view(rows_shape),
    )


class Scored(NamedTuple):
    """A token log-prob call's results on this rank's positions, before its verdict is
    checked: :func:`finish` checks it at once; the context-parallel entry points check it
    after their gather, so that every CP rank raises together."""

    logprobs: torch.Tensor  # fp32, the target's shape
    entropy: torch.Tensor | None  # fp32 [..., S] with return_entropy
    verdict: torch.Tensor  # fp32 [..., S] problem bits (_math.merge.PROBLEMS)


def finish(scored: Scored) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The public results of ``scored`` once its verdict is asserted (on the device)."""
    merge.assert_verdict(scored.verdict)
    if scored.entropy is None:
        return scored.logprobs
    return scored.logprobs, scored.entropy


def token_logprobs_of(
    logits: torch.Tensor,
    target: torch.Tensor,
    options: Options,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    filtering: tuple[int, float] | None = None,
    inplace_backward: bool = False,
) -> Scored:
    """:func:`~compiled_logprob.token_logprobs` of validated arguments (the context-parallel
    entry points call it for their local positions)."""
    per_position = target.dim() == logits.dim() - 1
    ids = target.unsqueeze(-1) if per_position else target  # [..., S, K]
    positions = logits.shape[:-1]
    if filtering is not None:
        logprobs, verdict = _filtered_logprobs(
            logits, ids, options, temperature, *filtering, inplace_backward=inplace_backward
        )
        return Scored(logprobs.view(target.shape), None, verdict.view(positions))
    result = stats(
        logits, ids, options, temperature, with_entropy=return_entropy,
        inplace_backward=inplace_backward,
    )
    return logprob_outputs(result, target, per_position, options.ignore_index, return_entropy)


def logprob_outputs(
    stats: Stats,
    target: torch.Tensor,
    per_position: bool,
    ignore_index: int | None,
    return_entropy: bool,
) -> Scored:
    """The log-probs of ``target`` (``[..., S]``, ``per_position``, or ``[..., S, K]``; 0
    where ignored) and, with ``return_entropy``, the entropy ``[..., S]`` (0 where every id
    of a position is ignored), from the ``stats`` (``target_logit`` ``[*, K]``, the rest
    ``[*]``) over the same positions, in any leading shape."""
    positions = target.shape if per_position else target.shape[:-1]
    logprobs = (stats.target_logit - stats.log_norm.unsqueeze(-1)).view(target.shape)
    verdict = stats.verdict.view(positions)
    if ignore_index is not None:
        logprobs = torch.where(target == ignore_index, 0.0, logprobs)
    if not return_entropy:
        return Scored(logprobs, None, verdict)
    entropy = stats.entropy.view(positions)
    if ignore_index is not None and (per_position or target.shape[-1]):
        # Positions whose every id is ignored (K = 0 ids ignore nothing).
        ignored = target == ignore_index
        entropy = torch.where(ignored if per_position else ignored.all(-1), 0.0, entropy)
    return Scored(logprobs, entropy, verdict)


def _filtered_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    options: Options,
    temperature: float | torch.Tensor,
    top_k: int,
    top_p: float,
    *,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated :func:`~compiled_logprob.token_logprobs` with filtering, of ``target`` ``[..., S, K]``:
    ``(logprobs, verdict)``, batched."""
    batched_target = _validation.as_batch(target, 2)
    stats = filtered_stats_of(
        _validation.as_batch(logits, 2),
        batched_target,
        _validation.temperature_rows(temperature, logits.shape[:-1], logits.device),
        **options._asdict(),
        top_k=top_k,
        top_p=top_p,
        inplace_backward=inplace_backward,
    )
    return filtered_logprobs(stats, batched_target, options.ignore_index), stats.verdict


def filtered_logprobs(
    stats: FilteredStats, target: torch.Tensor, ignore_index: int | None
) -> torch.Tensor:
    """The log-probs of ``target`` ``[B, S, K]`` under the filtered softmax of ``stats``:
    ``-inf`` where filtered out, 0 where ignored."""
    # A filtered-out id's log-prob is the constant -inf: no gradient flows from it.
    logprobs = torch.where(
        stats.target_logit == -torch.inf,
        -torch.inf,
        stats.target_logit - stats.log_norm.unsqueeze(-1),
    )
    if ignore_index is not None:
        logprobs = torch.where(target == ignore_index, 0.0, logprobs)
    return logprobs
