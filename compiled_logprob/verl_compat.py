"""Drop-in replacements for verl's log-prob and entropy helpers, over the functional API.

Swap the import and keep the call sites::

    # from verl.utils.torch_functional import logprobs_from_logits, entropy_from_logits
    from compiled_logprob.verl_compat import logprobs_from_logits, entropy_from_logits

``logprobs_from_logits``, ``entropy_from_logits`` and ``entropy_from_logits_with_chunking``
mirror ``verl/utils/torch_functional.py`` (FSDP actors: whole-vocabulary logits);
``vocab_parallel_log_probs_from_logits`` and ``vocab_parallel_entropy`` mirror
``verl/utils/megatron/tensor_parallel.py`` (Megatron actors: logits sharded evenly over the
tensor-parallel group, rank r holding ids ``[r · V_local, (r + 1) · V_local)``). What differs,
on purpose (docs/verl.md):

* every result is fp32 (verl's fallbacks return the logits' dtype; its flash-attn kernel and
  Megatron's cross-entropy return fp32 log-probs), from fp32 math whatever the logits' dtype;
* a label outside ``[0, V)`` is an error, detected on the device, not a log-prob of 0 or an
  out-of-bounds read;
* the logits are written only where verl's flash-attn kernel writes them: with
  ``inplace_backward`` (its default, as verl's), ``logprobs_from_logits``' backward puts the
  logits' gradient into a model's logits (not into a leaf tensor's); a later backward that
  needs those logits fails loudly (autograd's version check) instead of reading the
  gradient. Megatron's cross-entropy's in-place ``logits -= max`` on fp32 logits does not
  happen, so ``vocab_parallel_entropy`` and the Megatron log-probs may share one logits
  tensor (verl's Megatron actor clones it for that);
* the Megatron helpers take ``tp_group=``: by default Megatron's tensor-parallel group when
  ``megatron.core`` is initialised, else none (an unsharded vocabulary) in a single process;
* everything traces under ``torch.compile(fullgraph=True)`` with no host syncs.

Shape legend: ``V`` the full vocabulary, ``V_local`` this rank's shard of it.
"""

from __future__ import annotations

import sys
from typing import Literal

import torch
import torch.distributed as dist

from compiled_logprob import logits as _logits

__all__ = [
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "logprobs_from_logits",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs_from_logits",
]

MEGATRON: Literal["megatron"] = "megatron"


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """Drop-in for verl's ``logprobs_from_logits``: fp32 ``log_softmax(logits, -1)`` at
    ``labels``, of ``labels``' shape (``logits`` ``[..., V]``, ``labels`` ``[...]``).

    ``inplace_backward``, as verl's flash-attn kernel: the backward writes the logits'
    gradient into the logits themselves (no buffer of their size), where they are a model's
    output; a leaf tensor's values are kept (its gradient is a buffer of its own anyway).
    """
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r:.80}")
    inplace = inplace_backward and not (logits.requires_grad and logits.is_leaf)
    return _logits.token_logprobs(logits, labels, inplace_backward=inplace)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Drop-in for verl's ``entropy_from_logits``: fp32 entropy of ``softmax(logits, -1)``,
    ``[...]`` for ``logits`` ``[..., V]``."""
    return _logits.vocab_parallel_entropy(logits)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Drop-in for verl's ``entropy_from_logits_with_chunking``: the entropy of each row of
    ``logits`` ``[N, V]`` (any leading shape here), fp32, ``chunk_size`` rows at a time."""
    return _logits.vocab_parallel_entropy(logits, chunk_size=chunk_size)


def vocab_parallel_log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None | Literal["megatron"] = MEGATRON,
) -> torch.Tensor:
    """Drop-in for verl's Megatron ``vocab_parallel_log_probs_from_logits``: fp32 log-probs of
    the global ids ``labels`` ``[...]`` under logits sharded evenly over ``tp_group``
    (``logits`` ``[..., V_local]``), the same on every rank; verl's
    ``-vocab_parallel_cross_entropy(logits, labels)``."""
    group = _tensor_parallel_group(tp_group)
    rank = 0 if group is None else group.rank()
    return _logits.token_logprobs(logits, labels, vocab_start=rank * logits.shape[-1], group=group)


def vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None | Literal["megatron"] = MEGATRON,
) -> torch.Tensor:
    """Drop-in for verl's Megatron ``vocab_parallel_entropy``: the fp32 entropy of the full
    vocabulary's softmax at each position, from logits sharded over ``tp_group``
    (``[..., V_local]``), the same on every rank. The logits are not written (verl's
    backward mutates and restores them)."""
    group = _tensor_parallel_group(tp_group)
    return _logits.vocab_parallel_entropy(vocab_parallel_logits, group=group)


def _tensor_parallel_group(
    tp_group: dist.ProcessGroup | None | Literal["megatron"],
) -> dist.ProcessGroup | None:
    """``tp_group`` itself, or for ``"megatron"`` Megatron's tensor-parallel group when
    ``megatron.core`` is initialised, else ``None`` in a single process."""
    if tp_group is None or isinstance(tp_group, dist.ProcessGroup):
        return tp_group
    if tp_group != MEGATRON:
        raise TypeError(
            f"tp_group must be a torch.distributed.ProcessGroup, None or {MEGATRON!r}, got "
            f"{tp_group!r:.80}"
        )
    # Megatron's actors have imported it already; a lookup, not an import, traces whole.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "megatron.core's model parallelism is not initialised, and torch.distributed has "
            f"{dist.get_world_size()} ranks: pass tp_group= (the group that shards the "
            "vocabulary, or None for whole-vocabulary logits)"
        )
    return None
