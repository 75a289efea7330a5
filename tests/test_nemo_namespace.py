"""``compiled_logprob.nemo_compat`` mirrors ``nemo_rl.distributed.model_utils``: its
log-softmax names with NeMo-RL's signatures, ``top_k=0`` filtering nothing, and the drop-in
names at the top level deprecated in favour of it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import compiled_logprob as cl
from compiled_logprob import nemo_compat
from compiled_logprob.testing.reference import vocab_bounds


def test_top_level_drop_ins_are_deprecated():
    with pytest.warns(DeprecationWarning, match="compiled_logprob.nemo_compat"):
        dropin = cl.DistributedLogprob
    assert dropin is nemo_compat.DistributedLogprob
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in cl.__all__:
            getattr(cl, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cl.nope


def test_every_name_is_listed_once():
    assert len(nemo_compat.__all__) == len(set(nemo_compat.__all__))
    assert all(hasattr(nemo_compat, name) for name in nemo_compat.__all__)
    assert {"vocab_parallel_log_softmax", "vocab_parallel_full_log_softmax"} <= set(nemo_compat.__all__)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_softmax_names_without_a_group(temperature):
    """NeMo-RL's ``(logits, temperature, *, tp_group)``: fp32 ``log_softmax(logits / T)``."""
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    expected = torch.log_softmax(logits.detach().double() / temperature, -1)
    for fn in (nemo_compat.vocab_parallel_log_softmax, nemo_compat.vocab_parallel_full_log_softmax):
        out = fn(logits, temperature)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
        (grad,) = torch.autograd.grad(out.sum(), logits)
        assert grad.shape == logits.shape


def test_top_k_zero_filters_nothing():
    """As in NeMo-RL, a sampling ``top_k`` of 0 (or -1) means no top-k."""

    class Params:
        top_k, top_p = 0, 1.0

    logits = torch.randn(2, 6, 9)
    target = torch.randint(0, 9, (2, 6))
    plain = nemo_compat.from_parallel_logits_to_logprobs(logits, target, 0, 9, None)
    zero = nemo_compat.from_parallel_logits_to_logprobs(
        logits, target, 0, 9, None, sampling_params=Params()
    )
    assert torch.equal(plain, zero)


def _log_softmax_over_ranks() -> None:
    """Each rank's sharded and full log-softmax against the float64 oracle, and their
    gradients (the full one's gather passes each rank its own slice of its own upstream
    gradient, as Megatron's gather in NeMo-RL)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 10 * world  # the full log-softmax gathers equal shards
    start, end = vocab_bounds(vocab, world, rank)
    gen = torch.Generator().manual_seed(3)
    full = 3 * torch.randn(2, 7, vocab, generator=gen)
    upstream = torch.randn(2, 7, vocab, generator=gen)
    temperature = 0.8
    expected = torch.log_softmax(full.double() / temperature, -1)
    group = dist.group.WORLD

    shard = full[..., start:end].clone().requires_grad_()
    sharded = nemo_compat.vocab_parallel_log_softmax(shard, temperature, tp_group=group)
    torch.testing.assert_close(sharded.double(), expected[..., start:end], atol=1e-5, rtol=0)
    sharded.backward(upstream[..., start:end])
    reference = full.double().requires_grad_()
    torch.log_softmax(reference / temperature, -1).backward(upstream.double())
    torch.testing.assert_close(shard.grad.double(), reference.grad[..., start:end], atol=1e-5, rtol=0)

    shard = full[..., start:end].clone().requires_grad_()
    whole = nemo_compat.vocab_parallel_full_log_softmax(shard, temperature, tp_group=group)
    torch.testing.assert_close(whole.double(), expected, atol=1e-5, rtol=0)
    whole.backward(upstream)
    # Each rank's slice of the full output takes its own upstream gradient; the sharded
    # log-softmax's all-reduce then sums every rank's: the full gradient, sliced.
    torch.testing.assert_close(shard.grad.double(), reference.grad[..., start:end], atol=1e-5, rtol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_log_softmax_names_over_ranks(gloo_pool, world):
    gloo_pool(world).run(_log_softmax_over_ranks)
