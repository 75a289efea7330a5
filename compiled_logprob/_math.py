"""Per-shard math of the vocab-parallel log-softmax: plain, loop-free torch code.

Every function here works on one block of rows and is written so that Inductor fuses it
into a single pass over the logits. The eager kernels in ``_ops`` call these on
cache-sized row blocks; the Inductor decompositions call them once on the whole tensor.

Shape legend: ``B`` batch, ``S`` sequence, ``V_local`` this rank's vocabulary slice,
``R`` ranks of the vocab-parallel group, ``K`` target ids per position, ``F`` statistics
per row. The scaled logits are ``z = logits / temperature`` (``temperature`` ``[B, S]`` or
``None`` for 1); everything below is over ``z``, in fp32.

Statistics of one shard, stacked as ``[F, B, S]`` so one all-gather moves them all:
``[lse, entropy (with entropy), target_logit × K, owned × K]``.
"""

from __future__ import annotations

import torch

OWNERSHIP_ERROR = (
    "compiled_logprob: a target id is not owned by exactly one vocabulary shard: it is "
    "negative, >= the full vocabulary size, or the ranks' [vocab_start, vocab_end) ranges "
    "overlap or leave a gap. Clamp or mask such targets (pass ignore_index=... to get a "
    "log-prob of 0 and no gradient there), and give each rank its own shard bounds."
)


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``z = logits / temperature``, ``[B, S, V_local]``."""
    z = logits.float()
    return z if temperature is None else z / temperature.unsqueeze(-1)


def _mixture_entropy(
    log_weights: torch.Tensor, entropies: torch.Tensor | float, dim: int
) -> torch.Tensor:
    """Entropy ``Σ_i w_i · (H_i − log w_i)`` of a mixture of disjoint distributions with
    weights ``w = exp(log_weights)`` (summing to 1 along ``dim``) and entropies ``H``.

    Every term is non-negative, so nothing cancels: the error stays a few ulps of the
    logits, where ``lse − E[z]`` would lose ulps of ``|z|`` times ``|z|``. A component of
    weight 0 contributes 0, even when its ``log w`` is ``-inf`` or NaN (a whole -inf shard).
    """
    weights = torch.exp(log_weights)
    return torch.where(weights > 0, weights * (entropies - log_weights), 0.0).sum(dim)


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> torch.Tensor:
    """This shard's statistics, fp32 ``[F, B, S]`` (layout in the module docstring).

    ``lse`` and ``entropy`` (of this shard's own softmax) are over this shard; ``target_logit`` is ``z`` at the target where this shard owns it (0 elsewhere),
    and ``owned`` is 1.0 there. ``logits`` ``[B, S, V_local]``, ``target`` ``[B, S, K]``
    global vocabulary ids.
    """
    z = scaled_logits(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    stats = [lse.unsqueeze(0)]
    if with_entropy:
        # One token is a distribution of entropy 0: the shard's entropy is their mixture's.
        stats.append(_mixture_entropy(z - lse.unsqueeze(-1), 0.0, -1).unsqueeze(0))
    if target is not None:
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])
        picked = logits.gather(-1, torch.where(owned, local_target, 0)).float()
        if temperature is not None:
            picked = picked / temperature.unsqueeze(-1)
        stats.append(torch.where(owned, picked, 0.0).movedim(-1, 0))
        stats.append(owned.float().movedim(-1, 0))
    return torch.cat(stats)


def combine_stats(
    gathered: torch.Tensor,
    target: torch.Tensor | None,
    ignore_index: int | None,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the ranks' statistics ``[R, F, B, S]`` into ``(lse, target_logit, mean_logit)``.

    ``lse`` ``[B, S]``; ``target_logit`` ``[B, S, K]`` (0 where the target is ignored;
    ``K = 0`` without a target); ``mean_logit`` ``[B, S]`` is ``E_softmax[z]`` over the full
    vocabulary with entropy, else 0. Asserts, without a host sync, that every non-ignored
    target is owned by exactly one rank.
    """
    local_lse = gathered[:, 0]
    lse = torch.logsumexp(local_lse, dim=0)
    if with_entropy:
        # The full softmax is the mixture of the shards' with weights exp(lse_r − lse).
        mean_logit = lse - _mixture_entropy(local_lse - lse, gathered[:, 1], 0)
    else:
        mean_logit = torch.zeros_like(lse)
    if target is None:
        return lse, lse.new_zeros(*lse.shape, 0), mean_logit
    k = target.shape[-1]
    first = 2 if with_entropy else 1
    target_logit = gathered[:, first : first + k].sum(0).movedim(0, -1)
    owned_once = gathered[:, first + k : first + 2 * k].sum(0).movedim(0, -1) == 1
    if ignore_index is not None:
        ignored = target == ignore_index
        owned_once = owned_once | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    torch._assert_async(owned_once.all(), OWNERSHIP_ERROR)
    return lse, target_logit, mean_logit


def grad_logits(
    grad_lse: torch.Tensor,
    grad_target_logit: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    lse: torch.Tensor,
    vocab_start: int,
    ignore_index: int | None,
    *,
    temperature: torch.Tensor | None = None,
    grad_mean_logit: torch.Tensor | None = None,
    mean_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d(lse, target_logit, mean_logit)/d logits`` applied to the incoming gradients,
    in the logits' dtype, formed in fp32 and rounded once.

    With ``p = softmax(z)``: ``d lse/dz = p``, ``d target_logit_k/dz = onehot(target_k)``,
    ``d E_p[z]/dz = p · (1 + z − E_p[z])``, and ``dz/d logits = 1 / temperature``. For a
    token log-prob (``g_lse = −g``, ``g_target = g``) this is ``g · (onehot − p)``. Rows whose
    targets are all ignored get exactly 0, whatever their logits hold.
    """
    z = scaled_logits(logits, temperature)
    probs = torch.exp(z - lse.unsqueeze(-1))
    if grad_mean_logit is None:
        grad = grad_lse.unsqueeze(-1) * probs
    else:
        # Centre z before scaling: g_lse + g_E·(1 + z − E) keeps its precision where z ≈ E.
        centred = z - mean_logit.unsqueeze(-1)
        weight = grad_lse.unsqueeze(-1) + grad_mean_logit.unsqueeze(-1) * (1.0 + centred)
        grad = torch.where(probs > 0, probs * weight, 0.0)
    if target is not None:
        vocab_ids = torch.arange(logits.shape[-1], device=logits.device)
        is_target = vocab_ids == (target - vocab_start).unsqueeze(-1)  # [B, S, K, V_local]
        grad = grad + torch.where(is_target, grad_target_logit.unsqueeze(-1), 0.0).sum(-2)
        if ignore_index is not None:
            all_ignored = (target == ignore_index).all(-1, keepdim=True)
            grad = torch.where(all_ignored, 0.0, grad)
    if temperature is not None:
        grad = grad / temperature.unsqueeze(-1)
    return grad.to(logits.dtype)
