"""Drop-in replacements for the public names of NeMo-RL's ``nemo_rl/distributed/model_utils.py``.

Same signatures and semantics (positional arguments included), as thin wrappers over the
functional API. What differs, on purpose:

* a target id outside the full vocabulary is an error, not a silent log-prob of 0;
* ``group=None`` (or a group of size 1) means an unsharded vocabulary and needs no
  ``torch.distributed``;
* shards may be uneven: each rank passes its own ``vocab_start_index``/``vocab_end_index``;
* everything traces under ``torch.compile(fullgraph=True)`` with no host syncs.

The classes exist only so that ``X.apply(...)`` call sites keep working; they are not
``torch.autograd.Function`` subclasses (autograd lives in the custom ops).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_logprob import core

__all__ = ["ChunkedDistributedLogprob", "DistributedLogprob", "_compute_distributed_log_softmax"]


def _vocab_start(logits: torch.Tensor, vocab_start_index: int, vocab_end_index: int) -> int:
    """Check NeMo's redundant shard bounds against the shard's width; return the start."""
    width = logits.shape[-1]
    if vocab_end_index - vocab_start_index != width:
        raise ValueError(
            f"vocab_end_index - vocab_start_index = {vocab_end_index} - {vocab_start_index} = "
            f"{vocab_end_index - vocab_start_index}, but this rank's logits hold {width} vocabulary "
            f"entries (shape {tuple(logits.shape)}); pass this rank's own shard bounds"
        )
    return vocab_start_index


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
        start = _vocab_start(vocab_parallel_logits, vocab_start_index, vocab_end_index)
        if inference_only:
            vocab_parallel_logits = vocab_parallel_logits.detach()
        return core.token_logprobs(
            vocab_parallel_logits,
            target,
            vocab_start=start,
            group=tp_group,
            chunk_size=chunk_size,
        )


def _compute_distributed_log_softmax(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This shard of the full-vocabulary log-softmax, ``[B, S, V_local]`` in the logits' dtype.

    Drop-in for NeMo-RL's function of the same name (and differentiable, unlike its newest
    ``no_grad`` version).
    """
    return core.vocab_parallel_log_softmax(vocab_parallel_logits, group=group)
