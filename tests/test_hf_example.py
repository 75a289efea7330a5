"""examples/hf_tensor_parallel.py, run as a reader runs it: a Hugging Face causal LM (random
weights from a config) tensor-parallel over 2 gloo ranks, its compiled GRPO-style step's
log-probs from ``dtensor_logprobs`` and from ``lm_head_token_logprobs`` checked against the
unsharded float64 model. Needs ``transformers`` (the optional ``examples`` extra): skipped
without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_logprob.testing.multiprocess import default_timeout

pytest.importorskip("transformers")


def test_the_hugging_face_example_matches_the_float64_model():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "hf_tensor_parallel.py")],
        env=env, capture_output=True, text=True, timeout=default_timeout(300),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from logits: log-probs and LM-head gradient match" in done.stdout
    assert "from hidden states: log-probs and LM-head gradient match" in done.stdout
