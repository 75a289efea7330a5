"""Numerics of the vocab-parallel core against the float64 oracle, forward and backward.

Every case builds the same full logits on every rank (one seed), hands each rank its own
``vocab_bounds`` shard, and compares the rank's output and its gradient of
``sum(output * upstream)`` with the oracle's, sliced at the rank's vocabulary range.
Distributed cases run on the session's persistent gloo pools (``gloo_pool``), so the
functions sent there are module-level; the Hypothesis property runs *inside* the workers.

Tolerances (see ``check_numerics_case``): the oracle sees the logits exactly as given (already
rounded to bf16/fp16), so the only error left is fp32 math plus the final rounding of the
result into its dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DTYPES,
    FP32_EPS,
    NUMERICS_APIS,
    NUMERICS_CHUNKABLE,
    check_numerics_case,
    rank_and_size,
    tp_group,
)
from helpers import NumericsCase as Case
from hypothesis import strategies as st

import compiled_logprob as cl
from compiled_logprob._ops.blocks import seq_blocks
from compiled_logprob.testing.multiprocess import property_in_lockstep
from compiled_logprob.testing.reference import oracle_log_softmax, oracle_logsumexp, vocab_bounds

# NeMo's signatures take [B, S, V_local] logits only.
DROP_INS = ("DistributedLogprob", "ChunkedDistributedLogprob", "_compute_distributed_log_softmax")
WORLD_SIZES = (1, 2, 3, 4)
ODD_SHAPES = {
    "2d": dict(lead=(), seq=13),
    "B1": dict(lead=(1,), seq=13),
    "4d": dict(lead=(2, 3), seq=5),
    "S1": dict(lead=(1,), seq=1),
}


def _check_in_world(case: Case) -> None:
    check_numerics_case(case, dist.group.WORLD)


def _run_case(gloo_pool, world: int, case: Case) -> None:
    gloo_pool(world).run(_check_in_world, case)


def _check_bad_target(kind: str, api: str, chunk: int | None) -> str:
    """A target no rank owns raises on every rank; then the same process computes correctly."""
    rank, world = rank_and_size(dist.group.WORLD)
    vocab = 13
    end_0 = vocab_bounds(vocab, world, 0)[1]
    # "gap": rank r's shard moves up by r, so id end_0 lies between shards 0 and 1;
    # "overlap": it moves down by r, so id end_0 - 1 is owned by ranks 0 and 1.
    shift = {"gap": rank, "overlap": -rank}.get(kind, 0)
    start, end = (bound + shift for bound in vocab_bounds(vocab, world, rank))
    bad = {"negative": -1, "vocab_size": vocab, "gap": end_0, "overlap": end_0 - 1}[kind]
    logits = torch.randn(2, 7, end - start)
    # The same target on every rank, owned by rank 0 alone, whatever the kind.
    target = torch.randint(0, end_0 - 1, (2, 7), generator=torch.Generator().manual_seed(5))
    target[-1, -1] = bad  # in the last chunk: every earlier chunk's collective has completed
    try:
        if api == "token_logprobs":
            cl.token_logprobs(
                logits, target, vocab_start=start, group=dist.group.WORLD, chunk_size=chunk
            )
        else:
            cl.ChunkedDistributedLogprob.apply(logits, target, start, end, chunk, dist.group.WORLD)
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: target {bad} ({kind}) did not raise")
    _check_in_world(Case(api=api, chunk=chunk, dtype="bf16", seed=7))
    return message


def _check_property(max_examples: int) -> None:
    """The Hypothesis property, on every rank of the pool (a worker task)."""
    strategy = st.tuples(_cases(), st.integers(1, dist.get_world_size()))
    property_in_lockstep(strategy, _property_example, max_examples=max_examples)


@st.composite
def _cases(draw) -> Case:
    api = draw(st.sampled_from(NUMERICS_APIS))
    seq = draw(st.integers(1, 17))
    return Case(
        api=api,
        lead=draw(st.sampled_from([(1,), (3,)] if api in DROP_INS else [(), (1,), (3,), (2, 2)])),
        seq=seq,
        vocab=draw(st.integers(max(WORLD_SIZES), 80)),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        scale=draw(st.sampled_from([1e-3, 1.0, 30.0, 1000.0])),
        chunk=draw(st.none() | st.integers(1, seq + 2)) if api in NUMERICS_CHUNKABLE else None,
        ignore=api == "token_logprobs" and draw(st.booleans()),
        special=draw(st.sampled_from([None, None, "inf_shard", "nan_row"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _property_example(drawn: tuple[Case, int]) -> None:
    case, tp = drawn
    check_numerics_case(case, tp_group(tp))


# ---------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("api", NUMERICS_APIS)
def test_matches_oracle(gloo_pool, api, world, dtype):
    """Every entry point, even and uneven shards (V = 1003), every dtype."""
    chunk = 5 if api == "ChunkedDistributedLogprob" else None
    _run_case(gloo_pool, world, Case(api=api, dtype=dtype, chunk=chunk))


@pytest.mark.parametrize("chunk", [1, 4, 13, 20])
@pytest.mark.parametrize("api", NUMERICS_CHUNKABLE)
def test_chunked(gloo_pool, api, chunk):
    """Chunks that divide S, do not, equal it and exceed it, on uneven shards."""
    _run_case(gloo_pool, 3, Case(api=api, chunk=chunk, dtype="bf16", seed=1))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", ODD_SHAPES.values(), ids=ODD_SHAPES)
@pytest.mark.parametrize(
    "api", ["token_logprobs", "vocab_parallel_logsumexp", "vocab_parallel_log_softmax"]
)
def test_odd_shapes(gloo_pool, api, shape, world):
    """A tiny vocabulary (V = 7: shards of 2, 2, 2, 1), B = 1, S = 1, [S, V] and 4-D input."""
    _run_case(gloo_pool, world, Case(api=api, vocab=7, chunk=4, seed=2, **shape))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("special", ["x1000", "inf_shard", "nan_row"])
@pytest.mark.parametrize("api", NUMERICS_APIS)
def test_stability(gloo_pool, api, special, world, dtype):
    """Logits x1000; -inf padding with whole -inf shards (finite, exact); NaN stays in its row."""
    chunk = 4 if api in NUMERICS_CHUNKABLE else None
    case = Case(api=api, chunk=chunk, dtype=dtype, seed=3)
    if special == "x1000":
        case = dataclasses.replace(case, scale=1000.0)
    else:
        case = dataclasses.replace(case, special=special)
    _run_case(gloo_pool, world, case)


@pytest.mark.parametrize("special", [None, "nan_row"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ignore_index(gloo_pool, world, chunk, special):
    """Ignored positions: log-prob 0, gradient exactly 0 (even in a NaN row); others unchanged."""
    case = Case(ignore=True, chunk=chunk, special=special, dtype="bf16", seed=4)
    _run_case(gloo_pool, world, case)


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("api", ["token_logprobs", "ChunkedDistributedLogprob"])
@pytest.mark.parametrize(
    "kind, world",
    [
        ("negative", 1),
        ("vocab_size", 1),
        ("negative", 3),
        ("vocab_size", 4),
        ("gap", 2),
        ("gap", 4),
        ("overlap", 3),
    ],
)
def test_bad_target_raises_then_recovers(gloo_pool, kind, world, api, chunk):
    """Every rank raises the same RuntimeError (no hang); the process keeps working after it."""
    messages = gloo_pool(world).run(_check_bad_target, kind, api, chunk)
    assert all("not owned by exactly one vocabulary shard" in m for m in messages), messages


@pytest.mark.parametrize("api", NUMERICS_APIS)
def test_without_torch_distributed(api):
    """group=None in this very process, torch.distributed never initialised."""
    assert not dist.is_initialized(), "another test left torch.distributed initialised"
    check_numerics_case(Case(api=api, chunk=6 if api in NUMERICS_CHUNKABLE else None, dtype="bf16", seed=5), None)
    check_numerics_case(Case(api=api, vocab=7, lead=(1,), special="inf_shard", seed=6), None)
    assert not dist.is_initialized()


def test_property(gloo_pool):
    """Hypothesis over B, S, V, TP size (1-4, as subgroups of 4 ranks), chunk, dtype, scale,
    -inf/NaN rows and ignore_index, all APIs, forward and backward."""
    gloo_pool(4).run(_check_property, 120)


def _precision_outputs(logits: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    logprobs, entropy = cl.token_logprobs(logits, target, return_entropy=True)
    return [
        logprobs,
        entropy,
        cl.vocab_parallel_logsumexp(logits),
        cl.vocab_parallel_topk(logits, 3)[0],
        cl.vocab_parallel_log_softmax(logits, dtype=torch.float32),
        cl.token_logprobs(logits, target, temperature=0.25),
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_precision_does_not_degrade_with_logit_magnitude(compiled):
    """Log-probs, entropies and their gradients stay within a few ulps of their own size,
    as fp32 ``torch.log_softmax`` does, however large the logits: a shift of 3e4, a scale of
    1000 (peaked rows: entropies near 0) and both. Centring on the unscaled row max before
    the temperature and the logs is exact; an fp32 ``lse`` would cost ulps of ``|lse|``."""
    fn = torch.compile(_precision_outputs, fullgraph=True) if compiled else _precision_outputs
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 9, 1003, generator=gen, dtype=torch.float64)
    for shift, scale in ((3e4, 1.0), (0.0, 1000.0), (3e4, 30.0)):
        full = (base * scale + shift).float().double()
        logits = full.float().requires_grad_()
        target = full.argmax(-1)
        target[:, ::2] = torch.randint(0, 1003, (2, 5), generator=gen)
        log_softmax = oracle_log_softmax(full)
        slow = torch.log_softmax(full / 0.25, -1)
        refs = [
            log_softmax.gather(-1, target[..., None])[..., 0],
            -(log_softmax.exp() * log_softmax).sum(-1),
            oracle_logsumexp(full),
            log_softmax.topk(3).values,
            log_softmax,
            slow.gather(-1, target[..., None])[..., 0],
        ]
        outs = fn(logits, target)
        for name, out, ref in zip(("logprobs", "entropy", "lse", "topk", "log_softmax", "T"), outs, refs):
            error = (out.double() - ref).abs()
            assert (error <= 16 * FP32_EPS * (1 + ref.abs())).all(), (shift, scale, name, error.max())
        # d logprob / d logits = onehot − p: each entry within ulps of p (1 + |log p|).
        (grad,) = torch.autograd.grad(outs[0].sum(), logits)
        ref_grad = torch.nn.functional.one_hot(target, 1003) - log_softmax.exp()
        p = log_softmax.exp()
        bound = 16 * FP32_EPS * (p * (1 - log_softmax) + ref_grad.abs()) + 1e-44
        assert ((grad.double() - ref_grad).abs() <= bound).all(), (shift, scale)


@pytest.mark.parametrize(
    ("device", "shape", "blocks"),
    [
        # CPU: blocks sized for the cache, at most BLOCKS_PER_CALL of them.
        ("cpu", (2, 2048, 32000), 256),
        ("cpu", (1, 13, 1003), 1),
        # A GPU (meta stands in: any device but the CPU): 2^24-element blocks, so that each
        # op outlasts its launch, whatever the number of positions.
        ("meta", (2, 2048, 32000), 8),
        ("meta", (2, 8192, 32000), 32),
    ],
)
def test_eager_blocks_follow_the_device(device, shape, blocks):
    planned = seq_blocks(torch.empty(shape, device=device), None)
    assert len(planned) == blocks
    assert sum(rows.stop - rows.start for rows, _, _ in planned) >= shape[1]
