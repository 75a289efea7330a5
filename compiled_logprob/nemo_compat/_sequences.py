"""NeMo-RL's next-token log-probs of sequences: context parallel, packed and DTensor."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_logprob import _validation, context_parallel, dtensor, packed
from compiled_logprob.nemo_compat._arguments import (
    even_shard_start,
    sampling_filter,
    this_shard,
)


def _get_tokens_on_this_cp_rank(
    input_ids: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """CP rank ``cp_rank``'s load-balanced shard of ``input_ids`` along ``seq_dim``; see
    :func:`compiled_logprob.shard_for_context_parallel`.

    ``input_ids`` itself when ``cp_size == 1``, whatever the (int) ``cp_rank``: NeMo-RL calls
    it with ``torch.distributed.get_rank(cp_group)``, the global rank when there is no CP
    group. The sequence length must be a multiple of ``2 * cp_size`` (NeMo-RL silently drops
    the remainder: here it is a ``ValueError``).
    """
    cp_size = _validation.as_int(cp_size, "cp_size", minimum=1)
    cp_rank = _validation.as_int(cp_rank, "cp_rank")
    if cp_size == 1:
        return input_ids
    if not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"cp_rank must be in [0, cp_size = {cp_size}), got {cp_rank}: pass this rank's "
            "rank in the CP group"
        )
    return context_parallel.shard_rank(input_ids, cp_rank, cp_size, _validation.as_int(seq_dim, "seq_dim"))


class AllGatherCPTensor:
    """Drop-in for NeMo-RL's ``AllGatherCPTensor``; see
    :func:`compiled_logprob.gather_context_parallel`."""

    @staticmethod
    def apply(
        tensor: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int = 1
    ) -> torch.Tensor:
        """All CP ranks' load-balanced shards along ``seq_dim``, gathered in natural order.

        ``cp_group=None`` is, as in NeMo-RL, torch.distributed's default (WORLD) group; when
        torch.distributed is not initialised it means no CP, and ``tensor`` is returned as it is.
        """
        if cp_group is None and dist.is_available() and dist.is_initialized():
            cp_group = dist.group.WORLD
        return context_parallel.gather_context_parallel(tensor, group=cp_group, dim=seq_dim)


def allgather_cp_sharded_tensor(
    tensor: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int = 1
) -> torch.Tensor:
    """Drop-in for NeMo-RL's function of the same name: ``AllGatherCPTensor.apply`` (so
    ``cp_group=None`` is the default group when torch.distributed is initialised)."""
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup | None,
    inference_only: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    *,
    shift_targets: bool = True,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of ``[B, S_pad / CP, V_local]`` load-balanced
    logits and the full unshifted ``target`` ``[B, S]`` (``[B, S]``, position t scoring
    ``target[:, t]``, with ``shift_targets=False``), under ``sampling_params``' top-k/top-p
    filtering if any; see :func:`compiled_logprob.context_parallel_logprobs`."""
    vocab_parallel_logits, start = this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    return context_parallel.context_parallel_logprobs(
        vocab_parallel_logits,
        target,
        vocab_start=start,
        group=tp_group,
        cp_group=cp_group,
        chunk_size=chunk_size,
        next_token=shift_targets,
        **sampling_filter(sampling_params),
    )


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup | None,
    inference_only: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    target_is_pre_rolled: bool = False,
) -> torch.Tensor:
    """fp32 ``[B, unpacked_seqlen - 1]`` next-token log-probs of a packed ``[1, T / CP, V_local]``
    row (THD layout) and its unshifted ``target`` ``[1, T]``, or with ``target_is_pre_rolled``
    this rank's ``[1, T / CP]`` targets, already rolled within each sequence and CP-sharded
    like the logits, under ``sampling_params``' top-k/top-p filtering if any; see
    :func:`compiled_logprob.packed_context_parallel_logprobs`."""
    sampling = sampling_filter(sampling_params)
    vocab_parallel_logits, start = this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    if not target_is_pre_rolled:
        return packed.packed_context_parallel_logprobs(
            vocab_parallel_logits,
            target,
            cu_seqlens_padded,
            max_seqlen=unpacked_seqlen,
            vocab_start=start,
            group=group,
            cp_group=cp_group,
            chunk_size=chunk_size,
            **sampling,
        )
    local_fn = context_parallel.logits_local_fn(
        vocab_parallel_logits, target, vocab_start=start, group=group, chunk_size=chunk_size,
        ignore_index=None, return_entropy=False, inplace_backward=False, **sampling,
    )
    result = packed.packed_cp_logprobs(
        local_fn,
        vocab_parallel_logits,
        target,
        cu_seqlens_padded,
        max_seqlen=unpacked_seqlen,
        cp_group=cp_group,
        temperature=1.0,
        return_entropy=False,
        next_token=True,
        name="logits",
        pre_rolled=True,
    )
    return cast(torch.Tensor, result)  # the log-probs alone: no return_entropy


def dtensor_from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup | None,
    inference_only: bool = False,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    *,
    shift_targets: bool = True,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of local ``[B, S / CP, V_local]`` logits (``[B, S]``
    with ``shift_targets=False``); ``target`` is a tensor (no CP), or a DTensor sharded over mesh
    axis ``"cp"`` in ``seq_index`` order, under ``sampling_params``' top-k/top-p filtering if
    any; see :func:`compiled_logprob.dtensor_logprobs`."""
    vocab_parallel_logits, start = this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    result = dtensor.local_logprobs(
        vocab_parallel_logits,
        target,
        start,
        tp_group,
        seq_index,
        chunk_size,
        next_token=shift_targets,
        **sampling_filter(sampling_params),
    )
    return cast(torch.Tensor, result)  # the log-probs alone: no return_entropy


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits: torch.Tensor,
    input_ids: torch.Tensor,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of DTensor logits sharded on the vocabulary over
    mesh axis ``"tp"``, under ``sampling_params``' top-k/top-p filtering if any; see
    :func:`compiled_logprob.dtensor_logprobs`."""
    if not isinstance(vocab_parallel_logits, DTensor):
        raise TypeError(
            f"vocab_parallel_logits must be a DTensor, got {type(vocab_parallel_logits).__name__}; "
            "use from_parallel_logits_to_logprobs for plain tensors"
        )
    names = vocab_parallel_logits.device_mesh.mesh_dim_names
    if seq_index is not None and (names is None or "cp" not in names):
        raise ValueError(
            f"seq_index is given but the logits' device mesh (axes {names}) has no 'cp' axis"
        )
    return dtensor.dtensor_logprobs(
        vocab_parallel_logits,
        input_ids,
        seq_index=seq_index,
        chunk_size=chunk_size,
        **sampling_filter(sampling_params),
    )


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: torch.Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: dist.ProcessGroup | None = None,
    context_parallel_group: dist.ProcessGroup | None = None,
    sampling_params: object | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of ``input_ids`` ``[B, S]``, dispatched as NeMo-RL
    does: with ``vocab_parallel_group``, plain logits holding this rank's even vocabulary shard
    ``[vocab_parallel_rank * V_local, (vocab_parallel_rank + 1) * V_local)`` (CP over
    ``context_parallel_group``) go to :func:`from_parallel_logits_to_logprobs`; DTensor logits
    to :func:`get_logprobs_from_vocab_parallel_logits`; unsharded ``[B, S, V]`` logits to
    :func:`compiled_logprob.context_parallel_logprobs`. ``chunk_size`` bounds the eager
    temporaries on every path (NeMo-RL uses it on the first only; the values are the same).
    ``sampling_params``' top-k/top-p filtering applies on every path."""
    if vocab_parallel_group is not None:
        start = even_shard_start(next_token_logits, vocab_parallel_rank)
        return from_parallel_logits_to_logprobs(
            next_token_logits,
            input_ids,
            start,
            start + next_token_logits.shape[-1],
            vocab_parallel_group,
            cp_group=context_parallel_group,
            chunk_size=chunk_size,
            sampling_params=sampling_params,
        )
    if isinstance(next_token_logits, DTensor):
        return get_logprobs_from_vocab_parallel_logits(
            next_token_logits, input_ids, seq_index, chunk_size, sampling_params
        )
    return context_parallel.context_parallel_logprobs(
        next_token_logits, input_ids, chunk_size=chunk_size, **sampling_filter(sampling_params)
    )
