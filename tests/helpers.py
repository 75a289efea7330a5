"""What more than one test module uses, in one place: test modules import this module, the
conftest fixtures, the package and third-party libraries, never one another.

* The dtypes, ``ignore_index`` and fp32 constants of the oracle tests, and their
  elementwise tolerance check (:func:`assert_within`).
* Running a module's ``check_case(case, group)`` on TP = 1 in this process or on the
  session's gloo pools (:func:`run_cases`), in a Hypothesis property on TP subgroups
  (:func:`check_sharded_property`), or compiled (:func:`compiled_per_case`).
* The context-parallel layout: a ``("cp", "tp")`` mesh per process (:func:`cp_layout`) and
  the load-balanced CP shard by chunk-and-concat (:func:`ref_shard`,
  :func:`ref_shard_packed`), independent of the library's index maps.
* NeMo-RL's sampling parameters and the check of an error's message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from compiled_logprob.testing.multiprocess import property_in_lockstep

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE = -100
FP32_EPS = torch.finfo(torch.float32).eps
FP32_TINY = torch.finfo(torch.float32).smallest_normal * FP32_EPS  # the subnormal step


# ---------------------------------------------------------------------------------------
# Tolerances and the runners of the oracle tests' cases


def assert_within(actual, expected, bound, what: str) -> None:
    """``|actual - expected| <= bound`` elementwise; NaN and ±inf must sit at the same places."""
    actual, expected = actual.double(), expected.double()
    both_nan = actual.isnan() & expected.isnan()
    ok = (actual == expected) | ((actual - expected).abs() <= bound) | both_nan
    if not ok.all():
        bad = tuple((~ok).nonzero()[0].tolist())
        bound = bound.expand_as(expected)
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements off; first at {bad}: "
            f"ours {actual[bad].item()!r}, oracle {expected[bad].item()!r}, "
            f"bound {bound[bad].item()!r}"
        )


def rank_and_size(group) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` for ``group=None``."""
    return (0, 1) if group is None else (dist.get_rank(group), group.size())


def compiled_per_case(ours):
    """A test module's ``_ours(case, shard, target, start, group, option)`` under
    ``torch.compile(fullgraph=True)``, compiled afresh for each call's case and with no
    cached artifact (one of another form of the same graph would stand in for it)."""

    def call(case, shard, target, start, group, option):
        def run(shard, target, option):
            return ours(case, shard, target, start, group, option)

        torch._dynamo.reset()
        with torch.compiler.config.patch(force_disable_caches=True):
            return torch.compile(run, fullgraph=True)(shard, target, option)

    return call


# The world's ranks split into consecutive groups of each TP size (the last one possibly
# smaller), created once per worker: new_group is collective, so every rank makes every group.
_TP_GROUPS: dict[int, dist.ProcessGroup] = {}


def tp_group(tp: int) -> dist.ProcessGroup:
    """This rank's TP subgroup of size ``tp`` (a worker's; the groups are made on first use)."""
    if not _TP_GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        for size in range(1, world + 1):
            for first in range(0, world, size):
                ranks = list(range(first, min(first + size, world)))
                group = dist.new_group(ranks)
                if rank in ranks:
                    _TP_GROUPS[size] = group
    return _TP_GROUPS[tp]


def _check_in_world_group(check_case, cases: list) -> None:
    """``check_case(case, group)`` for each case, on the world group (a pool's worker task),
    or with ``group=None`` where torch.distributed is not initialised."""
    group = dist.group.WORLD if dist.is_initialized() else None
    for case in cases:
        check_case(case, group)


def run_cases(gloo_pool, world: int, check_case, cases: list) -> None:
    """:func:`_check_in_world_group` on ``world`` ranks: TP = 1 in this process (no
    torch.distributed), else on the session's gloo pool of that size."""
    if world == 1:
        _check_in_world_group(check_case, cases)
    else:
        gloo_pool(world).run(_check_in_world_group, check_case, cases)


def check_sharded_property(cases, check_case, max_examples: int) -> None:
    """A Hypothesis property in lockstep on every rank of the pool (a worker task):
    ``cases(world_size)`` draws ``(case, tp)``, and ``check_case(case, group)`` runs on the
    pool's TP subgroup of that size."""
    property_in_lockstep(
        cases(dist.get_world_size()),
        lambda drawn: check_case(drawn[0], tp_group(drawn[1])),
        max_examples=max_examples,
    )


# ---------------------------------------------------------------------------------------
# Context parallelism: the ("cp", "tp") mesh and the load-balanced layout, by chunk-and-concat

CP_BATCH = 2  # rows of the context-parallel cases
_MESHES: dict[tuple[int, int], object] = {}


def cp_layout(tp: int, cp: int):
    """``(mesh, tp_group, cp_group, tp_rank, cp_rank)``; the mesh is built once per process."""
    if (tp, cp) not in _MESHES:
        _MESHES[tp, cp] = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    mesh = _MESHES[tp, cp]
    return (
        mesh,
        mesh.get_group("tp"),
        mesh.get_group("cp"),
        mesh.get_local_rank("tp"),
        mesh.get_local_rank("cp"),
    )


def ref_shard(x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    """This rank's load-balanced CP shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2 · size − 1 − rank`` of its ``2 · size`` chunks, concatenated."""
    if size == 1:
        return x
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim)


def ref_shard_packed(x: torch.Tensor, bounds, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a packed row ``x`` ``[T, ...]``: each padded sequence ``[s, e)`` of
    ``bounds`` load-balanced-sharded on its own, concatenated."""
    return torch.cat([ref_shard(x[s:e], rank, size, 0) for s, e in bounds])


# ---------------------------------------------------------------------------------------
# Small shared pieces


@dataclasses.dataclass
class SamplingParams:
    """NeMo-RL's ``TrainingSamplingParams``, as its drop-ins read it."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def check_message(call, error: type[Exception], substrings: list[str]) -> None:
    """``call()`` raises ``error`` with a message containing every one of ``substrings``."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    missing = [s for s in substrings if s not in message]
    assert not missing, f"message {message!r} lacks {missing}"
