"""Per-shard math of the vocab-parallel log-softmax: plain, loop-free torch code.

Every function here works on one block of rows and is written so that Inductor fuses it
into a single pass over the logits. The eager kernels in ``_ops`` call these on
cache-sized row blocks; the Inductor decompositions call them once on the whole tensor.

Shape legend: ``B`` batch, ``S`` sequence, ``V_local`` this rank's vocabulary slice,
``R`` ranks of the vocab-parallel group, ``K`` statistics per row.
"""

from __future__ import annotations

import torch

OWNERSHIP_ERROR = (
    "compiled_logprob: a target id is not owned by exactly one vocabulary shard: it is "
    "negative, >= the full vocabulary size, or the ranks' [vocab_start, vocab_end) ranges "
    "overlap or leave a gap. Clamp or mask such targets (pass ignore_index=... to get a "
    "log-prob of 0 and no gradient there), and give each rank its own shard bounds."
)


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
) -> torch.Tensor:
    """This shard's per-row statistics, fp32 ``[K, B, S]``.

    Row 0 is the local logsumexp; with a target, row 1 is the target's logit where this
    shard owns the target (0 elsewhere) and row 2 is 1.0 where it owns it.
    ``logits`` ``[B, S, V_local]``, ``target`` ``[B, S]`` global vocabulary ids.
    """
    lse = torch.logsumexp(logits.float(), dim=-1)
    if target is None:
        return lse.unsqueeze(0)
    local_target = target - vocab_start
    owned = (local_target >= 0) & (local_target < logits.shape[-1])
    safe_index = torch.where(owned, local_target, 0).unsqueeze(-1)
    picked = logits.gather(-1, safe_index).squeeze(-1).float()
    target_logit = torch.where(owned, picked, 0.0)
    return torch.stack([lse, target_logit, owned.float()])


def combine_stats(
    gathered: torch.Tensor,
    target: torch.Tensor | None,
    ignore_index: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the ranks' statistics ``[R, K, B, S]`` into ``(lse, target_logit)``, ``[B, S]``.

    Asserts, without a host sync, that every non-ignored target is owned by exactly one rank.
    ``target_logit`` is 0 where the target is ignored or absent.
    """
    lse = torch.logsumexp(gathered[:, 0], dim=0)
    if target is None:
        return lse, torch.zeros_like(lse)
    target_logit = gathered[:, 1].sum(0)
    owned_once = gathered[:, 2].sum(0) == 1
    if ignore_index is not None:
        ignored = target == ignore_index
        owned_once = owned_once | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    torch._assert_async(owned_once.all(), OWNERSHIP_ERROR)
    return lse, target_logit


def grad_logits(
    grad_lse: torch.Tensor,
    grad_target_logit: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    lse: torch.Tensor,
    vocab_start: int,
    ignore_index: int | None,
) -> torch.Tensor:
    """``d(lse, target_logit)/d logits`` applied to the incoming gradients, in the logits' dtype.

    ``grad = g_lse · exp(z − lse) + g_target · onehot(target)``; for a token log-prob
    (``g_lse = −g``, ``g_target = g``) this is ``g · (onehot − softmax)``. Rows whose target
    is ignored get exactly 0, whatever their logits hold.
    """
    probs = torch.exp(logits.float() - lse.unsqueeze(-1))
    grad = grad_lse.unsqueeze(-1) * probs
    if target is not None:
        vocab_ids = torch.arange(logits.shape[-1], device=logits.device)
        is_target = vocab_ids == (target - vocab_start).unsqueeze(-1)
        grad = grad + torch.where(is_target, grad_target_logit.unsqueeze(-1), 0.0)
        if ignore_index is not None:
            grad = torch.where((target == ignore_index).unsqueeze(-1), 0.0, grad)
    return grad.to(logits.dtype)
