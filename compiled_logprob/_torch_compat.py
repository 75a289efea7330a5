"""Every private or version-dependent torch symbol the package uses, and the torch releases
it supports (docs/compatibility.md): an older torch is refused at import, rather than
failing with a missing collective or a silently wrong DTensor gradient later.

``COMPILED_LOGPROB_ALLOW_OLD_TORCH=1`` turns the refusal into a warning, for running the
single-process paths on an image whose torch is older (docs/compatibility.md lists what is
known to go wrong there)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.decomposition import register_decomposition
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = [
    "ALLOW_OLD_TORCH",
    "FakeTensorMode",
    "MINIMUM",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "assert_async",
    "register_decomposition",
    "release",
    "resolve_process_group",
    "wait_tensor",
]

MINIMUM = (2, 12)
ALLOW_OLD_TORCH = "COMPILED_LOGPROB_ALLOW_OLD_TORCH"


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.13.0a0+git1234"`` -> ``(2, 13)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


if release(torch.__version__) < MINIMUM:
    _problem = f"compiled_logprob needs torch >= {MINIMUM[0]}.{MINIMUM[1]}, found {torch.__version__}"
    if os.environ.get(ALLOW_OLD_TORCH) == "1":
        warnings.warn(
            f"{_problem}; running anyway because {ALLOW_OLD_TORCH}=1 (docs/compatibility.md "
            "lists what fails there)",
            stacklevel=2,
        )
    else:
        raise ImportError(
            f"{_problem}: pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}' "
            f"(or set {ALLOW_OLD_TORCH}=1 to run at your own risk)"
        )


# The functional all-gather (differentiable in both) is `all_gather_single` from torch 2.13,
# where the 2.12 name `all_gather_tensor` became a deprecated alias.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
all_reduce = funcol.all_reduce
all_to_all_single = funcol.all_to_all_single
wait_tensor = funcol.wait_tensor
# Checks a condition on the device, without a host sync.
assert_async = torch._assert_async
resolve_process_group = dist.distributed_c10d._resolve_process_group
