"""This shard of the full vocabulary's log-softmax, ``[B, S, V_local]``, from the per-row
statistics of ``compiled_logprob::vocab_parallel_stats``: an autograd function, not a custom
op, since it is elementwise torch code that Inductor fuses as it is.

Its output is sharded but depends on every shard, so its backward is the one place where a
gradient crosses ranks: one fp32 ``[B, S]`` all-reduce.
"""

from __future__ import annotations

import torch

from compiled_logprob import _comm


class LogSoftmax(torch.autograd.Function):
    """``(logits − shift) / temperature − log_norm`` with the gradient
    ``(G − softmax · sum(G)) / temperature`` formed in fp32, rounded once.

    The output is sharded but depends on every shard through ``log_norm``, so ``sum(G)``
    runs over the full vocabulary: one fp32 ``[..., S]`` all-reduce over the group.
    """

    @staticmethod
    def forward(ctx, logits, shift, log_norm, inverse_t, group_name, dtype):
        ctx.save_for_backward(logits, shift, log_norm)
        ctx.inverse_t, ctx.group_name = inverse_t, group_name
        return LogSoftmax.fp32(logits, shift, log_norm, inverse_t).to(dtype)

    @staticmethod
    def fp32(logits, shift, log_norm, inverse_t):
        return (logits.float() - shift.unsqueeze(-1)) * inverse_t - log_norm.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, shift, log_norm = ctx.saved_tensors
        grad = grad.float()
        grad_sum = grad.sum(-1)
        grad_sum = _comm.all_reduce_sum(grad_sum, ctx.group_name)
        softmax = torch.exp(LogSoftmax.fp32(logits, shift, log_norm, ctx.inverse_t))
        grad_logits = (grad - grad_sum.unsqueeze(-1) * softmax) * ctx.inverse_t
        return grad_logits.to(logits.dtype), None, None, None, None, None


def log_softmax_shard(
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_norm: torch.Tensor,
    inverse_t: float | torch.Tensor,
    group_name: str | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:class:`LogSoftmax` of ``logits`` ``[..., V_local]`` in ``dtype``, given their rows'
    ``shift`` and ``log_norm`` ``[...]`` and ``1 / temperature`` (a float or ``[..., 1]``)."""
    return LogSoftmax.apply(logits, shift, log_norm, inverse_t, group_name, dtype)
