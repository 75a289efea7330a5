"""``token_logprobs(..., inplace_backward=True)``: the backward writes the logits' gradient
into the logits' own storage and hands that storage on as the gradient, eager and compiled
(fullgraph), over TP; the same gradients as the out-of-place backward, the gradient's
storage is the logits', and a later backward that needs the logits fails loudly. The in-place
op's opcheck cases are in ``helpers.OPCHECK_CASES``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import compiled_logprob as cl
from compiled_logprob import verl_compat
from compiled_logprob.testing.reference import vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

OPTIONS = {
    "plain": {},
    "entropy": {"return_entropy": True, "temperature": 0.7},
    "filtered": {"top_k": 20, "top_p": 0.9},
    "chunked": {"chunk_size": 3, "ignore_index": 5},
}


def _inputs(dtype=torch.float32, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 9, 16, generator=gen).to(dtype)
    weight = torch.randn(vocab, 16, generator=gen).to(dtype)
    target = torch.randint(0, vocab, (2, 9), generator=gen)
    return hidden, weight, target


def _step(hidden, weight, target, options, inplace, fn=cl.token_logprobs, **shard):
    """The LM head's gradient of a loss of the log-probs (and entropy), with the logits (a
    model's output) and the gradient that reached them."""
    weight = weight.clone().requires_grad_()
    logits = hidden @ weight.T
    seen = []
    logits.register_hook(lambda grad: seen.append(grad))
    out = fn(logits, target, inplace_backward=inplace, **options, **shard)
    logprobs, entropy = out if options.get("return_entropy") else (out, None)
    loss = torch.where(logprobs.isinf(), 0.0, logprobs).sum()
    (loss + (0 if entropy is None else entropy.sum())).backward()
    return weight.grad, logits.detach(), seen[0]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_same_gradients_written_into_the_logits(name, dtype, compiled):
    hidden, weight, target = _inputs(dtype)
    fn = torch.compile(cl.token_logprobs, fullgraph=True) if compiled else cl.token_logprobs
    if compiled:
        torch._dynamo.reset()
    want, logits_before, want_grad = _step(hidden, weight, target, OPTIONS[name], False, fn)
    # (The sync check is a dispatch mode: eager only.)
    with no_host_syncs() if not compiled else contextlib.nullcontext():
        got, logits_after, got_grad = _step(hidden, weight, target, OPTIONS[name], True, fn)
    # Compiled, the in-place backward is the eager kernel: the last bits may differ.
    tol = {"rtol": 0, "atol": 0} if not compiled else {"rtol": 1e-5, "atol": 1e-6}
    if dtype == torch.bfloat16 and compiled:
        tol = {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_grad, want_grad, **tol)
    # The logits now hold their gradient: the gradient's storage is theirs.
    torch.testing.assert_close(logits_after, got_grad, rtol=0, atol=0)
    assert not torch.equal(logits_after, logits_before)


def test_a_later_backward_that_needs_the_logits_fails_loudly():
    hidden, weight, target = _inputs()
    logits = hidden @ weight.T.requires_grad_()
    # Saved before: its backward runs after ours, and finds the logits overwritten.
    squares = (logits**2).sum()
    loss = cl.token_logprobs(logits, target, inplace_backward=True).sum() + squares
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_leaf_logits_are_refused():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    with pytest.raises(ValueError, match="non-leaf"):
        cl.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), inplace_backward=True)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        cl.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), inplace_backward=1)


def test_verl_compat_writes_a_models_logits_as_verls_kernel_does():
    hidden, weight, target = _inputs()
    want, _, _ = _step(hidden, weight, target, {}, False)
    got, logits, grad = _step(hidden, weight, target, {}, True, fn=verl_compat.logprobs_from_logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(logits, grad, rtol=0, atol=0)


def _worker_tp(compiled: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, weight, target = _inputs(vocab=301)
    lo, hi = vocab_bounds(301, world, rank)
    fn = torch.compile(cl.token_logprobs, fullgraph=True) if compiled else cl.token_logprobs
    shard = {"vocab_start": lo, "group": dist.group.WORLD}
    runs = [_step(hidden, weight[lo:hi], target, {}, inplace, fn, **shard) for inplace in (False, True)]
    return runs[0][0], runs[1][0], torch.equal(runs[1][1], runs[1][2])


@pytest.mark.parametrize("compiled", [False, True])
def test_tensor_parallel(gloo_pool, compiled):
    for want, got, aliased in gloo_pool(2).run(_worker_tp, compiled):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert aliased
