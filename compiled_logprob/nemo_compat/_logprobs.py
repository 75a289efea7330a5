"""NeMo-RL's log-prob, entropy, log-softmax and cross-entropy of vocab-parallel logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_logprob import _comm, raw_logits
from compiled_logprob import logits as core
from compiled_logprob.nemo_compat._arguments import (
    filter_settings,
    sharding_group,
    this_shard,
)


class DistributedLogprob:
    """Drop-in for NeMo-RL's ``DistributedLogprob``; see :func:`compiled_logprob.token_logprobs`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of ``target`` ``[B, S]`` from ``[B, S, V_local]`` logits."""
        return ChunkedDistributedLogprob.apply(
            vocab_parallel_logits,
            target,
            vocab_start_index,
            vocab_end_index,
            None,
            group,
            inference_only,
        )


class ChunkedDistributedLogprob:
    """Drop-in for NeMo-RL's ``ChunkedDistributedLogprob``: the same values as
    :class:`DistributedLogprob`, computed ``chunk_size`` sequence positions at a time."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs; no temporary exceeds ``O(B * chunk_size * V_local)``."""
        vocab_parallel_logits, start = this_shard(
            vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
        )
        return core.token_logprobs(
            vocab_parallel_logits,
            target,
            vocab_start=start,
            group=tp_group,
            chunk_size=chunk_size,
        )


class DistributedLogprobWithSampling:
    """Drop-in for NeMo-RL's ``DistributedLogprobWithSampling``: log-probs under the top-k/top-p
    filtered distribution; see ``top_k``/``top_p`` of :func:`compiled_logprob.token_logprobs`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        top_k: int | None,
        top_p: float,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of ``target`` ``[B, S]`` from ``[B, S, V_local]`` logits,
        rank r of ``tp_group`` holding ids ``[r * V_local, (r + 1) * V_local)``."""
        return ChunkedDistributedLogprobWithSampling.apply(
            vocab_parallel_logits, target, tp_group, top_k, top_p, None, inference_only
        )


class ChunkedDistributedLogprobWithSampling:
    """Drop-in for NeMo-RL's ``ChunkedDistributedLogprobWithSampling``: the values of
    :class:`DistributedLogprobWithSampling`, ``chunk_size`` sequence positions at a time."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        top_k: int | None,
        top_p: float,
        chunk_size: int | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` filtered log-probs, as :class:`DistributedLogprobWithSampling`."""
        rank = 0 if tp_group is None or _comm.group_name(tp_group) is None else tp_group.rank()
        logits = vocab_parallel_logits.detach() if inference_only else vocab_parallel_logits
        return core.token_logprobs(
            logits,
            target,
            vocab_start=rank * logits.shape[-1],
            group=tp_group,
            chunk_size=chunk_size,
            **filter_settings(top_k, top_p),
        )


def _compute_distributed_log_softmax(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This shard of the full-vocabulary log-softmax, ``[B, S, V_local]`` in the logits' dtype.

    Drop-in for NeMo-RL's function of the same name (and differentiable, unlike its newest
    ``no_grad`` version).
    """
    return core.vocab_parallel_log_softmax(vocab_parallel_logits, group=group)


def _compute_distributed_log_softmax_with_grad(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's function of the same name: :func:`_compute_distributed_log_softmax`
    (differentiable either way here)."""
    return _compute_distributed_log_softmax(vocab_parallel_logits, group)


class ChunkedDistributedGatherLogprob:
    """Drop-in for NeMo-RL's ``ChunkedDistributedGatherLogprob``: log-probs at K global ids per
    position; see :func:`compiled_logprob.token_logprobs` with a ``[B, S, K]`` target."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        global_indices: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S, K]`` log-probs of ``global_indices`` ``[B, S, K]``."""
        if not isinstance(global_indices, torch.Tensor) or (
            global_indices.dim() != vocab_parallel_logits.dim()
        ):
            got = (
                tuple(global_indices.shape)
                if isinstance(global_indices, torch.Tensor)
                else type(global_indices).__name__
            )
            raise ValueError(
                f"global_indices must be [B, S, K] like the logits "
                f"{tuple(vocab_parallel_logits.shape)} ([B, S, V_local]), got {got}: for one id "
                "per position use DistributedLogprob"
            )
        return ChunkedDistributedLogprob.apply(
            vocab_parallel_logits,
            global_indices,
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only,
        )


class ChunkedDistributedEntropy:
    """Drop-in for NeMo-RL's ``ChunkedDistributedEntropy``: ``Σ_v p_v log p_v``, which is
    minus :func:`compiled_logprob.vocab_parallel_entropy`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` ``Σ p log p`` (the negative entropy, as NeMo-RL returns it) of the
        full-vocabulary softmax, differentiable unless ``inference_only``."""
        if inference_only:
            vocab_parallel_logits = vocab_parallel_logits.detach()
        return -core.vocab_parallel_entropy(
            vocab_parallel_logits, group=tp_group, chunk_size=chunk_size
        )


class DistributedCrossEntropy:
    """Drop-in for NeMo-RL's ``DistributedCrossEntropy``: the soft-target cross-entropy
    ``H(p_target, q_student)`` of a distillation loss; see
    :func:`compiled_logprob.vocab_parallel_cross_entropy`. As NeMo-RL, no gradient reaches
    ``target_logits``."""

    @staticmethod
    def apply(
        student_logits: torch.Tensor,
        target_logits: torch.Tensor,
        group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` ``−Σ_v p_v log q_v`` over the full vocabulary, from ``[B, S, V_local]``
        student and target logits; differentiable in the student's unless ``inference_only``."""
        if inference_only:
            student_logits = student_logits.detach()
        return core.vocab_parallel_cross_entropy(
            student_logits, target_logits.detach(), group=group
        )


def vocab_parallel_log_softmax(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_log_softmax``: fp32 ``log_softmax(logits /
    temperature)`` over the full vocabulary, kept vocab-sharded ``[B, S, V_local]`` (a
    DTensor's local shard); see :func:`compiled_logprob.vocab_parallel_log_softmax`.
    Differentiable: its backward all-reduces one fp32 ``[B, S]`` over ``tp_group``."""
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    return core.vocab_parallel_log_softmax(
        logits, group=sharding_group(tp_group), temperature=temperature, dtype=torch.float32
    )


def vocab_parallel_full_log_softmax(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_full_log_softmax``: :func:`vocab_parallel_log_softmax`
    gathered to the full vocabulary, fp32 ``[B, S, V]`` on every rank (every rank's shard of
    the same width); see :func:`compiled_logprob.gather_vocab_parallel`. As NeMo-RL's
    (Megatron's gather), each rank's logits receive the gradient of their own slice only."""
    group = sharding_group(tp_group)
    sharded = vocab_parallel_log_softmax(logits, temperature, tp_group=group)
    return raw_logits.gather_vocab_parallel(sharded, group=group)
