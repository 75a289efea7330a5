"""Every collective the package runs, and "who am I in this group".

Ops take a group by name (``group_name``: a custom op's schema holds a string, not a
``ProcessGroup``), public functions by object; ``None`` stands for an unsharded dimension
everywhere. All collectives are torch's functional ones, waited on at once: the compiler
sees them as graph nodes (and may overlap them), and no buffer is written in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from compiled_logprob._torch_compat import (
    all_gather_single,
    all_reduce,
    all_to_all_single,
    resolve_process_group,
    wait_tensor,
)

if TYPE_CHECKING:
    # torch's stubs type a group name as `GroupName`, a NewType of str. The names the ops
    # pass are `ProcessGroup.group_name` strings, so a cast (a no-op, also under Dynamo) is exact.
    from torch.distributed.distributed_c10d import GroupName


def group_name(group: dist.ProcessGroup | None) -> str | None:
    """The name the ops take, or ``None`` when the dimension is not sharded (no group, or a
    group of one rank)."""
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


def size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` of a validated group; ``(1, 0)`` for ``None`` or a group of one."""
    if group is None or group_name(group) is None:
        return 1, 0
    return group.size(), group.rank()


def named_size_rank(name: str | None) -> tuple[int, int]:
    """``(size, rank)`` of the group an op received by name; ``(1, 0)`` for ``None``. Eager
    only: Dynamo cannot trace the lookup (ops run it in their kernels and decompositions)."""
    if name is None:
        return 1, 0
    group = resolve_process_group(cast("GroupName", name))
    return group.size(), group.rank()


def gather_ranks(tensor: torch.Tensor, name: str | None, size: int | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` ``[B, ...]`` stacked as ``[R, B, ...]`` (one all-gather).
    ``size``: the group's, when the caller has it; otherwise it is looked up by name, which
    Dynamo cannot trace (ops and their decompositions may)."""
    if name is None:
        return tensor.unsqueeze(0)
    if size is None:
        size = named_size_rank(name)[0]
    # The size, not -1: an empty batch (B = 0) leaves -1 undetermined.
    return all_gather(tensor, name).view(size, *tensor.shape)


def all_gather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order. Differentiable: the
    backward is one reduce-scatter (sum) of the gradient."""
    return all_gather_single(tensor.contiguous(), 0, cast("GroupName", name))


def all_reduce_sum(tensor: torch.Tensor, name: str | None) -> torch.Tensor:
    """``Σ_ranks tensor`` (``tensor`` itself for ``None``); not differentiable."""
    if name is None:
        return tensor
    return wait_tensor(all_reduce(tensor, "sum", cast("GroupName", name)))


def all_to_all(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Rank ``r`` receives block ``r`` of every rank's ``tensor`` (dim 0 cut in ``R`` equal
    blocks), concatenated in rank order; not differentiable."""
    return wait_tensor(all_to_all_single(tensor.contiguous(), None, None, cast("GroupName", name)))


def all_gather_bytes(buffer: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's uint8 ``buffer`` (all of one size), eagerly, on the host's side: the
    agreement check's exchange, before a call's own collectives."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    buffer = buffer.to(device)
    parts = [torch.empty_like(buffer) for _ in range(group.size())]
    dist.all_gather(parts, buffer, group=group)
    return [part.cpu() for part in parts]
