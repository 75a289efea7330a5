"""NeMo-RL's argument conventions translated to the functional API's: shard bounds, filter
settings, group sizes."""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_logprob import _comm, _validation


def this_shard(
    logits: torch.Tensor, vocab_start_index: int, vocab_end_index: int, inference_only: bool
) -> tuple[torch.Tensor, int]:
    """The logits (detached for ``inference_only``) and the shard's start as a Python int,
    after checking NeMo's redundant shard bounds against the shard's width."""
    start = shard_start(
        logits.shape[-1], vocab_start_index, vocab_end_index, f"logits (shape {tuple(logits.shape)})"
    )
    return (logits.detach() if inference_only else logits), start


def shard_start(width: int, vocab_start_index: int, vocab_end_index: int, holder: str) -> int:
    """``vocab_start_index`` as a Python int, once NeMo's redundant shard bounds are checked
    against the ``width`` vocabulary entries that this rank's ``holder`` holds."""
    vocab_start_index = _validation.as_int(vocab_start_index, "vocab_start_index", minimum=0)
    vocab_end_index = _validation.as_int(vocab_end_index, "vocab_end_index")
    if vocab_end_index - vocab_start_index != width:
        raise ValueError(
            f"vocab_end_index - vocab_start_index = {vocab_end_index} - {vocab_start_index} = "
            f"{vocab_end_index - vocab_start_index}, but this rank's {holder} hold {width} "
            "vocabulary entries; pass this rank's own shard bounds"
        )
    return vocab_start_index


class FilterSettings(TypedDict):
    """The keyword arguments ``top_k`` and ``top_p`` of the functional API's log-probs."""

    top_k: int | None
    top_p: float


def filter_settings(top_k: int | None, top_p: float | None) -> FilterSettings:
    """NeMo-RL's filter settings as :func:`compiled_logprob.token_logprobs` takes them: its
    ``top_k`` of ``None``, 0 or -1 and ``top_p`` of ``None`` or 1.0 filter nothing."""
    return {"top_k": None if top_k in (-1, 0) else top_k, "top_p": 1.0 if top_p is None else top_p}


def sampling_filter(sampling_params: object | None) -> FilterSettings:
    """The ``top_k``/``top_p`` of ``sampling_params`` (NeMo-RL's ``TrainingSamplingParams``, or
    ``None``). Its ``temperature`` is not read, as NeMo-RL's functions here do not read it:
    their callers divide the logits by it."""
    if sampling_params is None:
        return filter_settings(None, 1.0)
    return filter_settings(getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0))


def even_shard_start(logits: torch.Tensor, vocab_parallel_rank: int | None) -> int:
    """``vocab_parallel_rank · V_local``: where this rank's even vocabulary shard starts."""
    if vocab_parallel_rank is None:
        raise ValueError(
            "vocab_parallel_rank must be given with vocab_parallel_group: this rank's "
            "index in the vocab-parallel group, which holds vocabulary shard "
            "[rank * V_local, (rank + 1) * V_local)"
        )
    return _validation.as_int(vocab_parallel_rank, "vocab_parallel_rank", minimum=0) * logits.shape[-1]


def group_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group`` (1 for ``None``, or without torch.distributed, as NeMo-RL's
    helpers treat both)."""
    if group is None or not dist.is_initialized():
        return 1
    _comm.group_name(group)  # validates it
    return group.size()


def even_tp_shard(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """``(logits, group, vocab_start)`` of this rank's even vocabulary shard (a DTensor's local
    one): the group is ``None`` when it has one rank (or torch.distributed is not
    initialised), and rank r's shard starts at ``r · V_local``."""
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    if tp_group is None or group_size(tp_group) == 1:
        return logits, None, 0
    return logits, tp_group, tp_group.rank() * logits.shape[-1]


def check_2d(tensor: torch.Tensor, name: str, size: int, *, dim: int) -> tuple[int, int]:
    """``tensor.shape`` of a 2-D tensor whose ``dim`` divides by ``size``."""
    if tensor.dim() != 2 or tensor.shape[dim] % size:
        raise ValueError(
            f"{name} must be 2-D with dim {dim} a multiple of the group size {size}, got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor.shape[0], tensor.shape[1]


def sharding_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` where it shards (two ranks or more), else ``None``: NeMo-RL's helpers treat a
    missing group, one rank and an uninitialised torch.distributed alike."""
    return group if group_size(group) > 1 else None
