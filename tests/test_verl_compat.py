"""``compiled_logprob.verl_compat`` against verl's semantics, restated from its source
(``verl/utils/torch_functional.py`` and ``verl/utils/megatron/tensor_parallel.py``, verl
b178a3c): the same values where verl computes in fp32, within the logits dtype's rounding
where verl computes in bf16, and the float64 oracle always; the Megatron helpers over TP 2
and 3; fullgraph compiled, without recompiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import check_compiled_without_recompiles

from compiled_logprob import verl_compat
from compiled_logprob.testing.frameworks import (
    verl_entropy_from_logits,
    verl_entropy_from_logits_with_chunking,
    verl_logprobs_from_logits,
)
from compiled_logprob.testing.reference import oracle_entropy, oracle_logprobs, vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(dtype: str, shape=(2, 13), vocab: int = 1002, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=gen)).to(DTYPES[dtype])
    labels = torch.randint(0, vocab, shape, generator=gen)
    return logits, labels, torch.randn(shape, generator=gen)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(2, 13), (13,), (1, 1)])
def test_fsdp_helpers_match_verl(dtype, shape):
    logits, labels, _ = _inputs(dtype, shape)
    u = torch.finfo(DTYPES[dtype]).eps
    with no_host_syncs():
        got_lp = verl_compat.logprobs_from_logits(logits, labels)
        got_ent = verl_compat.entropy_from_logits(logits)
    assert got_lp.dtype == got_ent.dtype == torch.float32
    torch.testing.assert_close(got_lp.double(), oracle_logprobs(logits, labels), rtol=0, atol=1e-5)
    torch.testing.assert_close(got_ent.double(), oracle_entropy(logits), rtol=0, atol=1e-5)
    # verl's own: the same in fp32; in bf16, within bf16 rounding at the logits' scale
    # (its entropy subtracts two sums of that size).
    for got, theirs in ((got_lp, verl_logprobs_from_logits(logits, labels)), (got_ent, verl_entropy_from_logits(logits))):
        atol = 1e-5 if dtype == "fp32" else 2 * u * logits.abs().max().item()
        torch.testing.assert_close(got, theirs.float(), rtol=0, atol=atol)
    flat = logits.reshape(-1, logits.shape[-1])
    torch.testing.assert_close(
        verl_compat.entropy_from_logits_with_chunking(flat, chunk_size=5),
        verl_entropy_from_logits_with_chunking(flat, chunk_size=5), rtol=0, atol=1e-5,
    )


def test_gradients_match_verl_and_leave_the_logits_alone():
    """fp32: the gradients of verl's fallbacks, and the logits unwritten (verl's flash-attn
    kernel with ``inplace_backward`` writes its gradient into them)."""
    logits, labels, up = _inputs("fp32")
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = (verl_compat.logprobs_from_logits(ours, labels, inplace_backward=True) * up).sum()
    (loss + verl_compat.entropy_from_logits(ours).sum()).backward()
    loss = (verl_logprobs_from_logits(theirs, labels) * up).sum()
    (loss + verl_entropy_from_logits(theirs).sum()).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-6)
    assert torch.equal(ours.detach(), logits)


def test_bad_labels_and_options_raise():
    logits, labels, _ = _inputs("fp32")
    with pytest.raises(RuntimeError, match="not owned by exactly one"):
        verl_compat.logprobs_from_logits(logits, labels + 1002)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        verl_compat.logprobs_from_logits(logits, labels, inplace_backward="yes")
    with pytest.raises(TypeError, match="tp_group must be"):
        verl_compat.vocab_parallel_entropy(logits, tp_group="tp")


def _worker_megatron(dtype: str):
    """The Megatron helpers on this rank's even shard; verl's
    ``-vocab_parallel_cross_entropy`` and ``vocab_parallel_entropy`` are the full
    vocabulary's log-probs and entropy on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, labels, up = _inputs(dtype)
    lo, hi = vocab_bounds(logits.shape[-1], world, rank)
    shard = logits[..., lo:hi].clone().requires_grad_()
    with no_host_syncs():
        lp = verl_compat.vocab_parallel_log_probs_from_logits(shard, labels, tp_group=dist.group.WORLD)
        ent = verl_compat.vocab_parallel_entropy(shard, tp_group=dist.group.WORLD)
        ((lp * up).sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), shard.grad, (lo, hi)


def _worker_without_megatron():
    logits, labels, _ = _inputs("fp32")
    try:
        verl_compat.vocab_parallel_log_probs_from_logits(logits[..., :501], labels)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_megatron_helpers_match_the_oracle(gloo_pool, world, dtype):
    logits, labels, up = _inputs(dtype)
    full = logits.double().requires_grad_()
    want_lp, want_ent = oracle_logprobs(full, labels), oracle_entropy(full)
    ((want_lp * up).sum() + want_ent.sum()).backward()
    u = torch.finfo(DTYPES[dtype]).eps
    for lp, ent, grad, (lo, hi) in gloo_pool(world).run(_worker_megatron, dtype):
        assert lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp.double(), want_lp.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), want_ent.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grad.double(), full.grad[..., lo:hi], rtol=0, atol=2 * u)


def test_megatron_group_is_required_without_megatron(gloo_pool):
    """Without ``megatron.core`` initialised, a sharded run must name its group: every rank
    raises alike rather than scoring its shard as the whole vocabulary."""
    for message in gloo_pool(2).run(_worker_without_megatron):
        assert message is not None and "pass tp_group=" in message


def test_megatron_helpers_in_one_process_take_the_whole_vocabulary():
    logits, labels, _ = _inputs("fp32")
    torch.testing.assert_close(
        verl_compat.vocab_parallel_log_probs_from_logits(logits, labels).double(),
        oracle_logprobs(logits, labels), rtol=0, atol=1e-5,
    )


@pytest.mark.parametrize("name", sorted(verl_compat.__all__))
def test_fullgraph_without_recompiles(name):
    def inputs_at(seq):
        logits, labels, _ = _inputs("bf16", (2, seq))
        return logits, (labels,) if "log_probs" in name or "logprobs" in name else ()

    check_compiled_without_recompiles(getattr(verl_compat, name), inputs_at)
