"""``compiled_logprob.trl_compat`` against TRL's own functions where TRL is installed (the
optional ``trl`` extra), and always against TRL's semantics restated from its source
(``trl/trainer/utils.py``, TRL f2cd577) and the float64 oracle; fullgraph compiled, without
recompiles.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_compiled_without_recompiles

from compiled_logprob import trl_compat
from compiled_logprob.testing.frameworks import trl_entropy_from_logits, trl_selective_log_softmax
from compiled_logprob.testing.reference import oracle_entropy, oracle_logprobs
from compiled_logprob.testing.sync_check import no_host_syncs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _references():
    """TRL's functions: the installed ones when TRL is, and the restatements always."""
    refs = [("restated", trl_selective_log_softmax, trl_entropy_from_logits)]
    try:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    except ImportError:
        return refs
    return [*refs, ("trl", selective_log_softmax, entropy_from_logits)]


def _inputs(dtype: str, shape=(2, 13), vocab: int = 1003, k: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=gen)).to(DTYPES[dtype])
    index = torch.randint(0, vocab, shape if k is None else (*shape, k), generator=gen)
    return logits, index


@pytest.mark.parametrize("source", [name for name, *_ in _references()])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("k", [None, 4])
def test_matches_trl(source, dtype, k):
    _, trl_select, trl_entropy = dict((name, (name, *fns)) for name, *fns in _references())[source]
    logits, index = _inputs(dtype, k=k)
    with no_host_syncs():
        got = trl_compat.selective_log_softmax(logits, index)
        entropy = trl_compat.entropy_from_logits(logits, chunk_size=5)
    assert got.shape == index.shape and got.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(got.double(), oracle_logprobs(logits, index), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), oracle_entropy(logits), rtol=0, atol=1e-5)
    # TRL's own: the same in fp32; in bf16, within bf16 rounding at the logits' scale
    # (its entropy subtracts two sums of that size).
    for ours, theirs in ((got, trl_select(logits, index)), (entropy, trl_entropy(logits, chunk_size=5))):
        atol = 1e-5 if dtype == "fp32" else 2 * torch.finfo(DTYPES[dtype]).eps * logits.abs().max().item()
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=atol)


def test_gradients_match_trl():
    logits, index = _inputs("fp32")
    up = torch.randn(index.shape)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ((trl_compat.selective_log_softmax(ours, index) * up).sum() + trl_compat.entropy_from_logits(ours).sum()).backward()
    ((trl_selective_log_softmax(theirs, index) * up).sum() + trl_entropy_from_logits(theirs).sum()).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-6)


def test_out_of_vocabulary_index_raises():
    logits, index = _inputs("fp32")
    with pytest.raises(RuntimeError, match="not owned by exactly one"):
        trl_compat.selective_log_softmax(logits, index - 1003)


@pytest.mark.parametrize("name", sorted(trl_compat.__all__))
def test_fullgraph_without_recompiles(name):
    def inputs_at(seq):
        logits, index = _inputs("bf16", (2, seq))
        return logits, (index,) if name == "selective_log_softmax" else ()

    check_compiled_without_recompiles(getattr(trl_compat, name), inputs_at)
