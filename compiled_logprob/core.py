"""Vocab-parallel token log-probs: the functional API.

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``V`` the full
vocabulary, ``V_local`` this rank's vocabulary slice ``[vocab_start, vocab_start + V_local)``.

Every function takes the logits of one vocabulary shard and returns values defined over the
*full* vocabulary: only per-row ``[B, S]`` statistics cross ranks (one all-gather per call,
or per chunk). The backward of the per-row results (log-probs, logsumexp) communicates
nothing; only the sharded log-softmax, whose every entry depends on every shard, all-reduces
one ``[B, S]`` vector in backward. All of it traces whole under
``torch.compile(fullgraph=True)``, performs no host synchronisation (so it can be captured
in CUDA graphs) and needs no ``torch.distributed`` at all when ``group`` is ``None``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from compiled_logprob import _ops

__all__ = ["token_logprobs", "vocab_parallel_log_softmax", "vocab_parallel_logsumexp"]


def _group_name(group: dist.ProcessGroup | None) -> str | None:
    """The name the ops take, or ``None`` when the vocabulary is not sharded."""
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if group.size() == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError(
            "a process group was passed but torch.distributed is not initialised (or was "
            "destroyed): call torch.distributed.init_process_group(...) first, or pass "
            "group=None for an unsharded vocabulary"
        )
    return group.group_name


def _as_batch(tensor: torch.Tensor, kept_dims: int) -> torch.Tensor:
    """Fold all leading dims but the last ``kept_dims`` into one batch dim (adding one if none):
    ``[..., S, V_local]`` -> ``[B, S, V_local]`` with ``kept_dims=2``."""
    if tensor.dim() == kept_dims:
        return tensor.unsqueeze(0)
    return tensor.flatten(0, -kept_dims - 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_logits(logits: torch.Tensor, chunk_size: int | None) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            f"logits must be a floating-point tensor, got dtype {logits.dtype}; "
            "pass the model's raw (vocab-parallel) logits"
        )
    if logits.dim() < 2:
        raise ValueError(
            f"logits must have shape [..., S, V_local], got shape {tuple(logits.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            f"this rank's vocabulary shard is empty (logits shape {tuple(logits.shape)}): shard a "
            "vocabulary over at most V ranks"
        )
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _validate_target(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int | None
) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold int64 (or int32) token ids, got dtype {target.dtype}; "
            "pass target.long()"
        )
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' leading shape "
            f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)} are [..., S, V_local])"
        )
    if target.device != logits.device:
        raise ValueError(
            f"target is on {target.device} but logits are on {logits.device}; "
            "move both to the same device"
        )
    if not _is_int(vocab_start) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    # A tensor would be read on the host by the op's int argument.
    if ignore_index is not None and not _is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")


def _stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    chunk_size: int | None,
    ignore_index: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (_as_batch(logits, 2), None if target is None else _as_batch(target, 1))
    options = dict(vocab_start=vocab_start, group_name=_group_name(group), ignore_index=ignore_index)
    if chunk_size is None:
        return _ops.vocab_parallel_stats(*args, **options)
    return _ops.vocab_parallel_stats_chunked(*args, **options, chunk_size=chunk_size)


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
) -> torch.Tensor:
    """Log-probability of each target token under the softmax over the full vocabulary.

    Eager equivalent: ``torch.log_softmax(full_logits.float(), -1).gather(-1, target[..., None])[..., 0]``
    where ``full_logits`` is the concatenation of every rank's shard along the vocabulary.

    Args:
        logits: ``[..., S, V_local]``, any floating dtype; the math runs in fp32.
        target: ``[..., S]`` global token ids (integer dtype).
        vocab_start: first global vocabulary id of this rank's shard.
        group: the vocab-parallel (tensor-parallel) group; ``None`` or a group of size 1 means
            the vocabulary is not sharded.
        chunk_size: process the sequence in chunks of this many positions (one collective per
            chunk), so that no temporary exceeds ``O(B * chunk_size * V_local)`` even in eager.
        ignore_index: targets equal to it get log-prob 0 and no gradient.

    Returns:
        fp32 ``[..., S]``, differentiable with respect to ``logits`` (gradient in their dtype).

    A target that is not in ``[0, V)`` (and not ``ignore_index``) raises an error, detected on
    the device without a host sync (``torch._assert_async``).
    """
    _validate_logits(logits, chunk_size)
    _validate_target(logits, target, vocab_start, ignore_index)
    lse, target_logit = _stats(
        logits,
        target,
        vocab_start=vocab_start,
        group=group,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
    )
    logprobs = (target_logit - lse).view(target.shape)
    if ignore_index is None:
        return logprobs
    return torch.where(target == ignore_index, 0.0, logprobs)


def vocab_parallel_logsumexp(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Logsumexp over the full (sharded) vocabulary, fp32 ``[..., S]``, differentiable.

    Eager equivalent: ``torch.logsumexp(full_logits.float(), -1)``.
    """
    _validate_logits(logits, chunk_size)
    lse, _ = _stats(
        logits, None, vocab_start=0, group=group, chunk_size=chunk_size, ignore_index=None
    )
    return lse.view(logits.shape[:-1])


def vocab_parallel_log_softmax(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This shard of the log-softmax over the full vocabulary, ``[..., S, V_local]``.

    Eager equivalent: ``torch.log_softmax(full_logits.float(), -1)[..., vocab_start:vocab_end]``.
    The result is ``dtype`` (default: the logits' dtype). Unlike the token log-probs this
    materialises a full ``[..., S, V_local]`` tensor; prefer :func:`token_logprobs` when
    only the targets' log-probs are needed. Its backward all-reduces one fp32 ``[..., S]``
    gradient over ``group``: every rank's output depends on every shard.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    lse = vocab_parallel_logsumexp(logits.detach(), group=group, chunk_size=chunk_size)
    return _LogSoftmax.apply(logits, lse, _group_name(group), dtype or logits.dtype)


class _LogSoftmax(torch.autograd.Function):
    """``logits - lse`` with the gradient ``G - softmax · sum(G)`` formed in fp32, rounded once.

    The output is sharded but depends on every shard through ``lse``, so ``sum(G)`` runs
    over the full vocabulary: one fp32 ``[..., S]`` all-reduce over the group.
    """

    @staticmethod
    def forward(ctx, logits, lse, group_name, dtype):
        ctx.save_for_backward(logits, lse)
        ctx.group_name = group_name
        return (logits.float() - lse.unsqueeze(-1)).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        grad = grad.float()
        grad_sum = grad.sum(-1)
        if ctx.group_name is not None:
            grad_sum = funcol.wait_tensor(funcol.all_reduce(grad_sum, "sum", ctx.group_name))
        softmax = torch.exp(logits.float() - lse.unsqueeze(-1))
        return (grad - grad_sum.unsqueeze(-1) * softmax).to(logits.dtype), None, None, None
