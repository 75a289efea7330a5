"""What more than one test module uses, in one place: test modules import this module, the
conftest fixtures, the package and third-party libraries, never one another.

* NeMo-RL's sampling parameters and the check of an error's message.
"""

from __future__ import annotations

import dataclasses

import pytest


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
