"""One shard's statistics: a single pass over its logits, before anything crosses ranks.

The statistics of a shard, fp32 ``[B, S, F]``, are raw sums, so that one loop over the
logits produces them all and the logs and divisions wait until after the exchange
(``merge``): ``[max x, Σ exp(u), Σ u · exp(u) (with entropy), x_target × K, owned × K]``
with ``u = (x − max x) / T``, or with a top-k ``[..., candidate x × k, candidate id × k]``
(``topk``) in place of the target's part. Maxima and logits travel unscaled (``x``, not
``z``): after the exchange ``(x − shift) / T`` is exact up to one rounding, so log-probs
keep their precision however large the logits are. The statistics are the last dimension:
Inductor's CPU code keeps a per-row epilogue inside the reduction loop only when it walks
the rows one at a time.
"""

from __future__ import annotations

import torch

from compiled_logprob._math.kernels import (
    EXPONENT_FLOOR,
    INF,
    PAIR_SLICES,
    Eager,
    Kernels,
    Traced,
    exponent_scale,
    finite_or_zero,
)


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    row_max: torch.Tensor | None = None,
    ops: Kernels = Traced(),
) -> torch.Tensor:
    """This shard's statistics, fp32 ``[B, S, F]`` (layout above; the top-k part is
    :func:`compiled_logprob._math.topk.topk_stats`').

    ``logits`` ``[B, S, V_local]``, ``target`` ``[B, S, K]`` global vocabulary ids.
    ``row_max`` ``[B, S, 1]``: the logits' max per row when the caller has it already (the
    top-k's block maxima give it). Traced on CUDA, the pass takes the form that Inductor's
    online softmax matches (:func:`online_softmax_stats`).
    """
    if not isinstance(ops, Eager) and row_max is None and uses_online_softmax(logits):
        stats = online_softmax_stats(logits, temperature, with_entropy)
    else:
        stats = shifted_stats(
            logits, temperature=temperature, with_entropy=with_entropy, row_max=row_max, ops=ops
        )
    if target is not None:
        stats.append(target_stats(logits, target, vocab_start))
    return torch.cat(stats, dim=-1)


def uses_online_softmax(logits: torch.Tensor) -> bool:
    """Whether Inductor's online softmax (Triton's only) can take the statistics' pass."""
    return logits.device.type == "cuda"


def shifted_stats(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    with_entropy: bool,
    row_max: torch.Tensor | None = None,
    ops: Kernels = Traced(),
) -> list[torch.Tensor]:
    """``[x_max, Σ exp(u)(, Σ u · exp(u))]`` as ``[B, S, 1]`` parts, ``u = (x − x_max) / T``,
    shifted by a finite max and exponentiated in ``ops``' units: the form of the eager
    kernels and of Inductor's CPU code. Eager, in place in ``ops.workspace`` (and
    ``ops.spare`` with entropy) when given."""
    workspace = ops.workspace
    x = ops.fp32(logits, workspace)
    if x is not logits and x.dtype != logits.dtype:
        workspace = x  # a fresh fp32 copy: shift it in place
    x_max = (ops.row_max(x) if row_max is None else row_max).float()
    (scale,) = ops.per_row(exponent_scale(temperature, ops))
    exponents = ops.scale(ops.minus(x, finite_or_zero(x_max), workspace), scale)
    if not with_entropy:
        return [x_max, ops.row_sum(ops.exp(exponents))]
    exps = ops.exp_into(exponents, ops.spare)
    total = ops.row_sum(exps, PAIR_SLICES)
    # e^c · c is NaN where c = -inf (vocabulary padding), for a term that is 0.
    weighted = ops.xexp_sum(exponents, exps)
    return [x_max, total, weighted * ops.unit]


def online_softmax_stats(
    logits: torch.Tensor, temperature: torch.Tensor | None, with_entropy: bool
) -> list[torch.Tensor]:
    """:func:`shifted_stats`' parts written as ``amax``, ``z − max``, ``exp``, ``sum`` of
    ``z = x / T``: the form Inductor's online softmax matches on CUDA, where Triton reads
    each row once for both the max and the sum. The guards come after the sums: an all
    ``-inf`` row sums to 0 and a ``+inf`` max to ``inf``, as :func:`finite_or_zero` makes the
    shifted form do."""
    x = logits.float()
    z = x if temperature is None else x * (1.0 / temperature.unsqueeze(-1))
    z_max = z.amax(-1, keepdim=True)
    centred = z - z_max
    exps = centred.exp()
    total = exps.sum(-1, keepdim=True)
    empty = z_max == -INF
    total = torch.where(empty, 0.0, torch.where(z_max == INF, INF, total))
    # A positive temperature is monotone: the max of z is the max of x, scaled.
    stats = [z_max if temperature is None else x.amax(-1, keepdim=True), total]
    if with_entropy:
        # exp(u) · u is NaN where u = -inf (vocabulary padding), for a term that is 0.
        weighted = (centred.clamp(min=EXPONENT_FLOOR) * exps).sum(-1, keepdim=True)
        stats.append(torch.where(empty, 0.0, weighted))
    return stats


def target_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The ``[x_target × K, owned × K]`` part of :func:`local_stats`, fp32 ``[B, S, 2K]``:
    ``x_target`` is the logit at each target where this shard owns it (0 elsewhere) and
    ``owned`` is 1.0 there. A gather of K entries per row, which eager kernels do once for
    all rows rather than block by block."""
    index, owned = local_ids(target, vocab_start, logits.shape[-1])
    picked = logits.gather(-1, index).float()
    return torch.cat([torch.where(owned, picked, 0.0), owned.float()], dim=-1)


def local_ids(
    target: torch.Tensor, vocab_start: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, owned)`` of global ids ``target``: their index in this shard of ``vocab``
    entries (0 where it does not own them, a safe index to gather or scatter at) and
    whether it owns them."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0), owned
