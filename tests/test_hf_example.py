"""examples/hf_tensor_parallel.py, run as a reader runs it: a Hugging Face causal LM (random
weights from a config) tensor-parallel over 2 gloo ranks, its compiled GRPO-style step's
log-probs from ``dtensor_logprobs`` and from ``lm_head_token_logprobs`` checked against the
unsharded float64 model. Needs ``transformers`` (the optional ``examples`` extra): skipped
without it."""

from __future__ import annotations

import pytest
from helpers import run_example

pytest.importorskip("transformers")


def test_the_hugging_face_example_matches_the_float64_model():
    out = run_example("hf_tensor_parallel.py", timeout=300)
    assert "from logits: log-probs and LM-head gradient match" in out
    assert "from hidden states: log-probs and LM-head gradient match" in out
