"""The torch releases this package supports (README, "Supported torch"): an older torch is
refused at import, rather than failing with a missing collective or a silently wrong
DTensor gradient later; the names that differ between supported releases are resolved here.

``COMPILED_LOGPROB_ALLOW_OLD_TORCH=1`` turns the refusal into a warning, for running the
single-process paths (benchmarks, CUDA-graph capture) on an image whose torch is older, as
the lent GPU machine's is; README lists what is known to go wrong there."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed._functional_collectives as funcol

MINIMUM = (2, 12)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.13.0a0+git1234"`` -> ``(2, 13)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


ALLOW_OLD_TORCH = "COMPILED_LOGPROB_ALLOW_OLD_TORCH"

if release(torch.__version__) < MINIMUM:
    _problem = f"compiled_logprob needs torch >= {MINIMUM[0]}.{MINIMUM[1]}, found {torch.__version__}"
    if os.environ.get(ALLOW_OLD_TORCH) == "1":
        warnings.warn(
            f"{_problem}; running anyway because {ALLOW_OLD_TORCH}=1 (README, 'Supported torch', "
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
