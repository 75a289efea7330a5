"""NeMo-RL's log-probs straight from sequence-parallel hidden states (its linear-CE-fusion
path), over :func:`compiled_logprob.lm_head_token_logprobs` with ``sequence_parallel``.

Shape legend: ``S`` sequence, ``B`` batch, ``H`` hidden size, ``TP`` the tensor-parallel
group's size, ``V_local`` this rank's vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_logprob import lm_head
from compiled_logprob.nemo_compat._arguments import group_size, shard_start, sharding_group


class ChunkedDistributedHiddenStatesToLogprobs:
    """Drop-in for NeMo-RL's ``ChunkedDistributedHiddenStatesToLogprobs``; see
    :func:`compiled_logprob.lm_head_token_logprobs` (``sequence_parallel=True``)."""

    @staticmethod
    def apply(
        tensor_parallel_hidden_states: torch.Tensor,
        target: torch.Tensor,
        output_weight_layer: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of ``target`` ``[B, S]`` (already shifted: position t
        scores ``target[:, t]``) on every rank of ``tp_group``.

        ``tensor_parallel_hidden_states`` is Megatron's sequence-first, sequence-parallel
        shard ``[S / TP, B, H]`` (``[S, B, H]`` without a group), gathered over ``tp_group``
        inside; its gradient is reduce-scattered back to that shape. ``output_weight_layer``
        ``[V_local, H]`` is this rank's slice ``[vocab_start_index, vocab_end_index)`` of the
        LM-head weight, in the hidden states' dtype, and gets this rank's gradient.
        ``chunk_size`` sequence positions at a time (``None``: a 64 MiB logits tile);
        ``inference_only`` detaches both inputs.
        """
        hidden = tensor_parallel_hidden_states
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise ValueError(
                "tensor_parallel_hidden_states must be Megatron's sequence-first hidden states "
                f"[S / TP, B, H], got {getattr(hidden, 'shape', type(hidden).__name__)}"
            )
        weight = output_weight_layer
        if isinstance(weight, torch.Tensor):
            start = shard_start(
                weight.shape[0], vocab_start_index, vocab_end_index,
                f"output_weight_layer (shape {tuple(weight.shape)})",
            )
        else:
            start = 0  # lm_head_token_logprobs names the type
        if inference_only:
            hidden, weight = hidden.detach(), weight.detach()
        return lm_head.lm_head_token_logprobs(
            hidden.transpose(0, 1),
            weight,
            target,
            vocab_start=start,
            group=sharding_group(tp_group),
            chunk_size=chunk_size,
            sequence_parallel=True,
        )


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup | None,
    inference_only: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``from_parallel_hidden_states_to_logprobs``: fp32 ``[B, S - 1]``
    next-token log-probs, position t scoring ``target[:, t + 1]``, from Megatron's
    sequence-parallel hidden states ``[S / TP, B, H]`` and this rank's LM-head slice, as
    :class:`ChunkedDistributedHiddenStatesToLogprobs`. ``runtime_gather_output`` is unused
    (as in NeMo-RL). Context parallelism is refused, as NeMo-RL refuses it here:
    :func:`compiled_logprob.lm_head_context_parallel_logprobs` takes CP shards."""
    if group_size(cp_group) > 1:
        raise ValueError(
            "from_parallel_hidden_states_to_logprobs does not support context parallelism "
            f"(cp_group has {group_size(cp_group)} ranks), as in NeMo-RL: call "
            "compiled_logprob.lm_head_context_parallel_logprobs(hidden.transpose(0, 1), weight, "
            "input_ids, cp_group=..., sequence_parallel=True) instead"
        )
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of token ids, got {type(target).__name__}")
    logprobs = ChunkedDistributedHiddenStatesToLogprobs.apply(
        tensor_parallel_hidden_states,
        target.roll(shifts=-1, dims=-1),
        output_weight_layer,
        vocab_start_index,
        vocab_end_index,
        chunk_size,
        tp_group,
        inference_only,
    )
    return logprobs[:, :-1]
