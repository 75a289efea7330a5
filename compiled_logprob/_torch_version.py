"""The torch releases this package supports (README, "Supported torch"): an older torch is
refused at import, rather than failing with a missing collective or a silently wrong
DTensor gradient later; the names that differ between supported releases are resolved here."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

MINIMUM = (2, 12)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.13.0a0+git1234"`` -> ``(2, 13)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


if release(torch.__version__) < MINIMUM:
    raise ImportError(
        f"compiled_logprob needs torch >= {MINIMUM[0]}.{MINIMUM[1]}, found {torch.__version__}: "
        f"pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}'"
    )


# The functional all-gather (differentiable in both) is `all_gather_single` from torch 2.13,
# where the 2.12 name `all_gather_tensor` became a deprecated alias.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
