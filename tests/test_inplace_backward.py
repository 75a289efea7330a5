"""``inplace_backward=True``: the backward writes the logits' gradient into the logits' own
storage and hands that storage on as the gradient, eager and compiled (fullgraph), over TP
and, through the context-parallel, packed and DTensor entry points, over a TP × CP grid; the
same gradients as the out-of-place backward, the gradient's storage is the logits', and a
later backward that needs the logits fails loudly. The in-place op's opcheck cases are in
``helpers.OPCHECK_CASES``.
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
from helpers import cp_layout, ref_shard, ref_shard_packed
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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


@pytest.mark.parametrize("fn", [cl.token_logprobs, cl.context_parallel_logprobs])
def test_leaf_logits_are_refused(fn):
    logits = torch.randn(2, 3, 11, requires_grad=True)
    with pytest.raises(ValueError, match="non-leaf"):
        fn(logits, torch.zeros(2, 3, dtype=torch.long), inplace_backward=True)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        fn(logits, torch.zeros(2, 3, dtype=torch.long), inplace_backward=1)


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


def _grid_calls(tp: int, cp: int):
    """``{entry point: (this rank's hidden states, call(logits, **options))}`` on the TP × CP
    grid, each rank's LM-head slice ``[lo, hi)`` of an even vocabulary (DTensor's split)."""
    mesh, tp_group, cp_group, tp_rank, cp_rank = cp_layout(tp, cp)
    gen = torch.Generator().manual_seed(1)
    seq, vocab = 8, 302
    hidden = torch.randn(2, seq, 16, generator=gen)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)
    seq_index = torch.randperm(seq, generator=gen)
    cu, bounds = torch.tensor([0, 8, 16]), [(0, 8), (8, 16)]
    lo, hi = vocab_bounds(vocab, tp, tp_rank)
    shard = {"vocab_start": lo, "group": tp_group, "cp_group": cp_group}
    target = distribute_tensor(ids[:, seq_index], mesh, [Shard(1), Replicate()])

    def on_dtensor(logits, **options):
        sharded = DTensor.from_local(logits, mesh, [Shard(1), Shard(2)], run_check=False)
        return cl.dtensor_logprobs(sharded, target, seq_index=seq_index, **options)

    calls = {
        "context_parallel": (
            ref_shard(hidden, cp_rank, cp, 1),
            lambda logits, **options: cl.context_parallel_logprobs(logits, ids, **shard, **options),
        ),
        "packed": (
            ref_shard_packed(hidden.flatten(0, 1), bounds, cp_rank, cp)[None],
            lambda logits, **options: cl.packed_context_parallel_logprobs(
                logits, ids.view(1, -1), cu, max_seqlen=8, **shard, **options
            ),
        ),
        "dtensor": (hidden[:, seq_index].chunk(cp, 1)[cp_rank], on_dtensor),
    }
    weight = torch.randn(vocab, 16, generator=gen)[lo:hi]
    return calls, weight


def _worker_grid(compiled: bool):
    """Per entry point: the LM head slice's gradient out of place and in place, and whether
    the in-place gradient is the logits' storage."""
    calls, weight = _grid_calls(2, 2)
    results = {}
    for name, (hidden, call) in calls.items():
        fn = torch.compile(call, fullgraph=True) if compiled else call
        runs = []
        for inplace in (False, True):
            runs.append(_step(hidden, weight, None, {}, inplace, lambda x, _, **kw: fn(x, **kw)))
        results[name] = (runs[0][0], runs[1][0], torch.equal(runs[1][1], runs[1][2]))
    return results


@pytest.mark.parametrize("compiled", [False, True])
def test_context_parallel_packed_and_dtensor(gloo_pool, compiled):
    for results in gloo_pool(4).run(_worker_grid, compiled):
        for name, (want, got, aliased) in results.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
            assert aliased, name


def _worker_leaf_dtensor():
    mesh = cp_layout(2, 1)[0]
    leaf = distribute_tensor(torch.randn(2, 8, 302), mesh, [Replicate(), Shard(2)])
    try:
        cl.dtensor_logprobs(leaf.requires_grad_(), torch.zeros(2, 8, dtype=torch.long), inplace_backward=True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_leaf_dtensor_logits_are_refused(gloo_pool):
    for message in gloo_pool(2).run(_worker_leaf_dtensor):
        assert "non-leaf" in message
