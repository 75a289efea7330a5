"""NeMo-RL's hidden-state drop-ins (``nemo_compat``): Megatron's sequence-first,
sequence-parallel hidden states ``[S / TP, B, H]`` in, NeMo-RL's semantics out, against a
float64 re-statement of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compiled_logprob import nemo_compat
from compiled_logprob.testing.reference import vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs


def _nemo_inputs(seed: int = 0, seq: int = 12, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, 2, 16, generator=gen).to(dtype)  # [S, B, H], sequence first
    weight = (torch.randn(1003, 16, generator=gen) / 2).to(dtype)
    target = torch.randint(0, 1003, (2, seq), generator=gen)
    return hidden, weight, target, torch.randn(2, seq, generator=gen, dtype=torch.float64)


def _nemo_oracle(target: torch.Tensor, up: torch.Tensor, **inputs):
    """NeMo-RL's semantics in float64: logits of the whole sequence's hidden states
    transposed to ``[B, S, V]``, the log-prob of ``target`` at each position."""
    hidden, weight = (inputs[n].double().requires_grad_() for n in ("hidden", "weight"))
    logits = (hidden @ weight.T).transpose(0, 1)
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    grads = torch.autograd.grad((lp * up[:, : lp.shape[1]]).sum(), [hidden, weight])
    return lp.detach(), *grads


def _run_nemo(name: str, rank: int, world: int, group, chunk_size=5):
    hidden, weight, target, up = _nemo_inputs()
    lo, hi = vocab_bounds(1003, world, rank)
    part = hidden.shape[0] // world
    h = hidden[rank * part : (rank + 1) * part].clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    if name == "ChunkedDistributedHiddenStatesToLogprobs":
        out = nemo_compat.ChunkedDistributedHiddenStatesToLogprobs.apply(
            h, target, w, lo, hi, chunk_size, group
        )
    else:
        out = nemo_compat.from_parallel_hidden_states_to_logprobs(
            h, w, False, target, lo, hi, group, chunk_size=chunk_size
        )
    (out.double() * up[:, : out.shape[1]]).sum().backward()
    return out.detach(), h.grad, w.grad


def _worker_nemo(name: str):
    with no_host_syncs():
        return _run_nemo(name, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


NEMO_NAMES = ["ChunkedDistributedHiddenStatesToLogprobs", "from_parallel_hidden_states_to_logprobs"]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", NEMO_NAMES)
def test_nemo_hidden_state_drop_ins_match_nemo_semantics(gloo_pool, name, world):
    """Sequence-first SP shards ``[S / TP, B, H]`` in, ``[B, S]`` log-probs of the (already
    shifted) targets out, on every rank; ``from_parallel_hidden_states_to_logprobs`` shifts
    the targets itself and drops the last position. The hidden states' gradient comes back
    as this rank's shard; the weight's is this rank's slice's."""
    hidden, weight, target, up = _nemo_inputs()
    if name == "from_parallel_hidden_states_to_logprobs":
        target = target.roll(-1, -1)
    lp, grad_h, grad_w = _nemo_oracle(target, up, hidden=hidden, weight=weight)
    if name == "from_parallel_hidden_states_to_logprobs":
        lp, (grad_h, grad_w) = lp[:, :-1], _nemo_oracle(target[:, :-1], up, hidden=hidden[:-1], weight=weight)[1:]
        grad_h = torch.cat([grad_h, torch.zeros_like(grad_h[:1])])  # the dropped position
    runs = [_run_nemo(name, 0, 1, None)] if world == 1 else gloo_pool(world).run(_worker_nemo, name)
    part = hidden.shape[0] // world
    for rank, (got, got_h, got_w) in enumerate(runs):
        lo, hi = vocab_bounds(1003, world, rank)
        assert got.shape == lp.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(got_h.double(), grad_h[rank * part : (rank + 1) * part], rtol=0, atol=2e-5)
        torch.testing.assert_close(got_w.double(), grad_w[lo:hi], rtol=0, atol=2e-5)


def test_nemo_hidden_state_drop_ins_refuse_what_nemo_refuses():
    hidden, weight, target, _ = _nemo_inputs()
    with pytest.raises(ValueError, match="vocab_end_index - vocab_start_index"):
        nemo_compat.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden, target, weight, 0, 1000, 4, None)
    with pytest.raises(ValueError, match=r"sequence-first hidden states \[S / TP, B, H\]"):
        nemo_compat.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden[0], target, weight, 0, 1003, 4, None)
    with pytest.raises(RuntimeError, match="not owned by exactly one"):
        nemo_compat.ChunkedDistributedHiddenStatesToLogprobs.apply(hidden, target + 1003, weight, 0, 1003, 4, None)
    out = nemo_compat.ChunkedDistributedHiddenStatesToLogprobs.apply(
        hidden.requires_grad_(), target, weight, 0, 1003, None, None, True
    )
    assert not out.requires_grad, "inference_only keeps no graph"


def _worker_nemo_cp():
    try:
        hidden, weight, target, _ = _nemo_inputs()
        nemo_compat.from_parallel_hidden_states_to_logprobs(
            hidden, weight, False, target, 0, 1003, None, cp_group=dist.group.WORLD
        )
    except ValueError as error:
        return str(error)
    return None


def test_nemo_hidden_states_refuse_context_parallelism(gloo_pool):
    for message in gloo_pool(2).run(_worker_nemo_cp):
        assert message is not None and "lm_head_context_parallel_logprobs" in message
