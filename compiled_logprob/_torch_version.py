"""Refuses a torch older than the oldest one the test suite passes on, at import, rather than
with a missing collective or a silently wrong DTensor gradient later (README, "Supported
torch")."""

from __future__ import annotations

import torch

MINIMUM = (2, 13)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.13.0a0+git1234"`` -> ``(2, 13)``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


if release(torch.__version__) < MINIMUM:
    raise ImportError(
        f"compiled_logprob needs torch >= {MINIMUM[0]}.{MINIMUM[1]}, found {torch.__version__}: "
        f"pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}'"
    )
