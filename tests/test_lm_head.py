"""``lm_head_token_logprobs``: log-probs and entropy from hidden states, against a float64 oracle.

Every case builds the same hidden states, full LM-head weight and targets on every rank (one
seed); each rank takes its ``vocab_bounds`` slice of the weight. The oracle is
``log_softmax`` in float64 of the logits ``hidden @ weight.T`` *as rounded by a matmul in the
inputs' dtype* (what the op itself computes per tile), so the tolerances are fp32 math
plus the rounding of the gradients' matmuls in the inputs' dtype (see
``helpers.check_lm_head``). The ops' opcheck cases are in ``helpers.OPCHECK_CASES`` (run by
``test_compile_contract``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    IGNORE,
    LM_HEAD_CASES,
    LM_HEAD_DTYPES,
    case_id,
    check_lm_head,
    check_message,
    lm_head_backward,
    lm_head_inputs,
    lm_head_options,
    lm_head_oracle,
    lm_head_oracle_of,
    lm_head_temperature,
    lm_head_tiles,
    run_lm_head,
)
from helpers import LMHeadCase as Case
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import compiled_logprob as cl
from compiled_logprob.lm_head import lm_head_token_logprobs, lm_head_topk
from compiled_logprob.lm_head_context_parallel import (
    lm_head_context_parallel_logprobs,
    lm_head_packed_context_parallel_logprobs,
)
from compiled_logprob.testing.reference import oracle_log_softmax, vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs


def _worker_run(case: Case) -> dict[str, torch.Tensor]:
    with no_host_syncs():
        return run_lm_head(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("case", LM_HEAD_CASES, ids=case_id)
def test_single_process_matches_oracle(case):
    with no_host_syncs():
        got = run_lm_head(case, 0, 1, None)
    check_lm_head(case, got, lm_head_oracle(case), 0, 1)


@settings(max_examples=150, deadline=None)
@given(
    lead=st.sampled_from([(1,), (2,), (2, 3)]),
    seq=st.integers(1, 15),
    hidden=st.integers(1, 16),
    vocab=st.integers(1, 600),
    dtype=st.sampled_from(sorted(LM_HEAD_DTYPES)),
    chunk=st.one_of(st.none(), st.integers(1, 6)),
    ignore=st.booleans(),
    temperature=st.sampled_from([1.0, 0.3, 2.5, "rows", "positions"]),
    entropy=st.booleans(),
    k=st.one_of(st.none(), st.integers(1, 4)),
    scale=st.sampled_from([1.0, 1000.0]),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle_over_shapes(**fields):
    """Odd shapes (S = 1, V or H = 1, chunks that do not divide S), dtypes, temperatures
    (float, per row, per position), K ids, ignored ids and logits x1000, single process."""
    case = Case(**fields)
    with no_host_syncs():
        got = run_lm_head(case, 0, 1, None)
    check_lm_head(case, got, lm_head_oracle(case), 0, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", LM_HEAD_CASES[:6], ids=case_id)
def test_tensor_parallel_matches_oracle(gloo_pool, world, case):
    want = lm_head_oracle(case)
    for rank, got in enumerate(gloo_pool(world).run(_worker_run, case)):
        check_lm_head(case, got, want, rank, world)


# --- Tiles cut into blocks of the vocabulary (several per chunk of positions) ---

BLOCK_CASES = [
    Case(vocab=3 * 1024 + 100, chunk=None),
    Case(vocab=3 * 1024 + 100, dtype="bf16", ignore=True, temperature="rows", chunk=3),
    Case(vocab=2 * 1024 + 1, k=2, temperature="positions", chunk=None, scale=1000.0),
    Case(vocab=2 * 1024 + 1, fp32_logits=True, dtype="bf16", ignore=True, chunk=None),
]


def _run_in_blocks(case: Case, rank: int, world: int, group, tile_elements: int):
    """:func:`run_lm_head` with tiles of ``tile_elements``: a small number cuts each chunk
    into blocks of whole ``TILE_WIDTH`` tiles of the vocabulary."""
    with lm_head_tiles(tile_elements), no_host_syncs():
        return run_lm_head(case, rank, world, group)


def _worker_blocks(case: Case):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [_run_in_blocks(case, rank, world, dist.group.WORLD, n) for n in (4096, 1 << 30)]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_id)
def test_vocabulary_blocks_match_whole_rows_and_the_oracle(case):
    """Blocks give the log-probs and entropy of whole rows bit for bit (the same tiles,
    reduced in the same order) and gradients within the oracle's bounds."""
    blocks = _run_in_blocks(case, 0, 1, None, 4096)
    whole = _run_in_blocks(case, 0, 1, None, 1 << 30)
    for name in ("lp", "ent"):
        assert torch.equal(blocks[name], whole[name]), name
    check_lm_head(case, blocks, lm_head_oracle(case), 0, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_blocks_over_tensor_parallel(gloo_pool, world):
    case = BLOCK_CASES[1]
    want = lm_head_oracle(case)
    for rank, (blocks, whole) in enumerate(gloo_pool(world).run(_worker_blocks, case)):
        for name in ("lp", "ent"):
            assert torch.equal(blocks[name], whole[name]), name
        check_lm_head(case, blocks, want, rank, world)


# --- lm_head_topk: the top k of each position, scored like K ids ---

TOPK_CASES = [
    Case(k=8, entropy=False),
    Case(k=5, dtype="bf16", temperature="rows", chunk=None, entropy=False),
    Case(k=3, lead=(2, 3), seq=6, vocab=517, hidden=8, chunk=4, temperature="positions", entropy=False),
    Case(k=2, seq=5, vocab=600, hidden=4, scale=1000.0, entropy=False),
]


def _run_topk(case: Case, rank: int, world: int, group, api=lm_head_topk):
    """This rank's top-k log-probs and ids, and the gradients of ``Σ lp·up``."""
    hidden, weight, _, up_lp, up_ent = lm_head_inputs(case)
    lo, hi = vocab_bounds(case.vocab, world, rank)
    hidden = hidden.requires_grad_()
    weight = weight[lo:hi].clone().requires_grad_()
    options = dict(vocab_start=lo, chunk_size=case.chunk, temperature=lm_head_temperature(case))
    values, ids = api(hidden, weight, case.k, group=group, **options)
    return lm_head_backward(case, values, hidden, weight, up_lp, up_ent), ids


def _worker_topk(case: Case):
    with no_host_syncs():
        return _run_topk(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


def _check_topk(case: Case, got: dict[str, torch.Tensor], ids: torch.Tensor, rank: int, world: int):
    """The ids are a top k of the float64 softmax (their log-probs its k largest, in order:
    ties may pick other ids), and log-probs and gradients are the oracle's at those ids."""
    hidden, weight, _, up_lp, up_ent = lm_head_inputs(case)
    assert ids.dtype == torch.int64 and ids.shape == (*case.lead, case.seq, case.k)
    want = lm_head_oracle_of(case, hidden, weight, ids, up_lp, up_ent)
    check_lm_head(case, got, want, rank, world)
    logits = (hidden @ weight.T).double()
    temperature = lm_head_temperature(case)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double().unsqueeze(-1)
    top = oracle_log_softmax(logits / temperature).topk(case.k).values
    u = torch.finfo(LM_HEAD_DTYPES[case.dtype]).eps / 2
    atol = 1e-5 * (1 + want["zmax"]) + 2 * u * want["zmax"]
    torch.testing.assert_close(got["lp"].double(), top, rtol=0, atol=atol, msg="top-k values")


@pytest.mark.parametrize("case", TOPK_CASES, ids=case_id)
def test_topk_single_process_matches_oracle(case):
    with no_host_syncs():
        got, ids = _run_topk(case, 0, 1, None)
    _check_topk(case, got, ids, 0, 1)


@settings(max_examples=60, deadline=None)
@given(
    lead=st.sampled_from([(1,), (2, 3)]),
    seq=st.integers(1, 9),
    hidden=st.integers(1, 12),
    vocab=st.integers(1, 700),
    k=st.integers(1, 12),
    dtype=st.sampled_from(sorted(LM_HEAD_DTYPES)),
    chunk=st.one_of(st.none(), st.integers(1, 4)),
    temperature=st.sampled_from([1.0, 0.3, "rows", "positions"]),
    scale=st.sampled_from([1.0, 1000.0]),
    seed=st.integers(0, 2**16),
)
def test_topk_matches_oracle_over_shapes(**fields):
    """Shards narrower than the block maxima need (plain torch.topk) and wider (block
    maxima with a partial tail block), k = V, ties in bf16, logits x1000."""
    case = Case(**dict(fields, k=min(fields["k"], fields["vocab"])), entropy=False)
    with no_host_syncs():
        got, ids = _run_topk(case, 0, 1, None)
    _check_topk(case, got, ids, 0, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", TOPK_CASES[:2], ids=case_id)
def test_topk_tensor_parallel_matches_oracle(gloo_pool, world, case):
    for rank, (got, ids) in enumerate(gloo_pool(world).run(_worker_topk, case)):
        _check_topk(case, got, ids, rank, world)


# A last block of 3 ids joins the one before it (a block's top k needs k ids); bf16 with
# ties, whose ids blocks and whole rows may pick differently.
TOPK_BLOCK_CASES = [
    Case(k=8, vocab=2 * 1024 + 3, chunk=None, temperature="positions", entropy=False),
    Case(k=5, vocab=3 * 1024 + 100, dtype="bf16", temperature="rows", chunk=3, entropy=False),
]


def _topk_in_blocks(case: Case, rank: int, world: int, group):
    """:func:`_run_topk` with tiles cut into blocks of the vocabulary, and with whole rows."""
    runs = []
    for elements in (4096, 1 << 30):
        with lm_head_tiles(elements), no_host_syncs():
            runs.append(_run_topk(case, rank, world, group))
    return runs


def _worker_topk_blocks(case: Case):
    return _topk_in_blocks(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


def _check_topk_blocks(case, blocks, whole, rank, world):
    (got, ids), (want, want_ids) = blocks, whole
    assert torch.equal(got["lp"], want["lp"]), "top-k log-probs of blocks vs whole rows"
    if case.dtype == "fp32":  # no ties
        assert torch.equal(ids, want_ids)
    _check_topk(case, got, ids, rank, world)


@pytest.mark.parametrize("case", TOPK_BLOCK_CASES, ids=case_id)
def test_topk_vocabulary_blocks_match_whole_rows_and_the_oracle(case):
    """The blocks' merged top k are the whole rows' (values bit for bit)."""
    _check_topk_blocks(case, *_topk_in_blocks(case, 0, 1, None), 0, 1)


def test_topk_vocabulary_blocks_over_tensor_parallel(gloo_pool):
    case = TOPK_BLOCK_CASES[1]
    for rank, runs in enumerate(gloo_pool(2).run(_worker_topk_blocks, case)):
        _check_topk_blocks(case, *runs, rank, 2)


def _worker_topk_compiled(case: Case, seqs: tuple[int, ...]) -> int:
    """Compiled (fullgraph) forward and backward equal eager; returns the graphs compiled."""
    torch._dynamo.reset()
    compiled = torch.compile(lm_head_topk, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for seq in seqs:
        args = (dataclasses.replace(case, seq=seq), dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
        (want, want_ids), (got, got_ids) = _run_topk(*args), _run_topk(*args, api=compiled)
        assert torch.equal(got_ids, want_ids), f"ids at S={seq}"
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"{name} at S={seq}")
    return counters["stats"]["unique_graphs"] - before


def test_topk_compiled_matches_eager_without_recompiles(gloo_pool):
    # fp32: in bf16, compiled and eager may sum the k upstream gradients in another order
    # and round a gradient entry the other way.
    case = Case(k=5, temperature="rows", entropy=False)
    graphs = gloo_pool(2).run(_worker_topk_compiled, case, (13, 29, 40))
    assert all(count <= 2 for count in graphs), graphs


def _worker_compiled(case: Case, seqs: tuple[int, ...]) -> list[int]:
    """Compiled (fullgraph) forward and backward equal eager for several sequence lengths;
    returns the number of graphs compiled."""
    torch._dynamo.reset()
    compiled = torch.compile(lm_head_token_logprobs, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for seq in seqs:
        args = (dataclasses.replace(case, seq=seq), dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
        want, got = run_lm_head(*args), run_lm_head(*args, api=compiled)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"{name} at S={seq}")
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize(
    "case",
    [Case(ignore=True, temperature=0.7), Case(ignore=True, temperature="positions", k=3)],
    ids=case_id,
)
def test_compiled_matches_eager_without_recompiles(gloo_pool, case):
    graphs = gloo_pool(2).run(_worker_compiled, case, (13, 29, 40))
    assert all(count <= 2 for count in graphs), graphs


def test_target_out_of_range_raises():
    hidden, weight, target, _, _ = lm_head_inputs(Case())
    with pytest.raises(RuntimeError, match="not owned by exactly one"):
        lm_head_token_logprobs(hidden, weight, torch.full_like(target, 1003))


def test_frozen_inputs_get_no_gradient_work():
    """A frozen LM head (or frozen hidden states) gets no gradient buffer: the backward forms
    only what autograd asks for, with the same values."""
    hidden, weight, target, _, _ = lm_head_inputs(Case())
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    both = torch.autograd.grad(lm_head_token_logprobs(hidden, weight, target).sum(), [hidden, weight])
    for frozen, trained in ((weight, hidden), (hidden, weight)):
        frozen.requires_grad_(False)
        out = lm_head_token_logprobs(hidden, weight, target).sum()
        (grad,) = torch.autograd.grad(out, trained)
        torch.testing.assert_close(grad, both[0] if trained is hidden else both[1], rtol=0, atol=0)
        frozen.requires_grad_(True)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(hidden=torch.ones(2, 3, 4, dtype=torch.long)), TypeError, "floating-point"),
        (dict(weight=torch.ones(5, 3)), ValueError, r"\[V_local, H\] with H = 4"),
        (dict(weight=torch.ones(5, 4, dtype=torch.float64)), TypeError, "share dtype"),
        (dict(target=torch.ones(2, 3)), TypeError, "integer token ids"),
        (dict(target=torch.ones(2, 4, dtype=torch.long)), ValueError, "leading shape"),
        (dict(vocab_start=-1), ValueError, "vocab_start"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
    ],
)
def test_bad_input(change, error, match):
    args = dict(hidden=torch.ones(2, 3, 4), weight=torch.ones(5, 4), target=torch.ones(2, 3, dtype=torch.long))
    args.update(change)
    hidden, weight, target = args.pop("hidden"), args.pop("weight"), args.pop("target")
    with pytest.raises(error, match=match):
        lm_head_token_logprobs(hidden, weight, target, **args)


HIDDEN = torch.randn(2, 3, 4)
WEIGHT = torch.randn(5, 4)
TARGET = torch.randint(0, 5, (2, 3))


def _lm_head(hidden=HIDDEN, weight=WEIGHT, target=TARGET, **options):
    return lambda: lm_head_token_logprobs(hidden, weight, target, **options)


# name: (call, exception type, substrings the message must contain), as in test_errors.py
BAD_INPUT_CASES = {
    "hidden_1d": (
        _lm_head(hidden=torch.randn(4), target=torch.tensor(1)),
        ValueError,
        ["[..., S, H]", "(4,)"],
    ),
    "hidden_int": (_lm_head(hidden=HIDDEN.long()), TypeError, ["floating-point", "torch.int64"]),
    "empty_vocab_shard": (
        _lm_head(weight=torch.randn(0, 4)),
        ValueError,
        ["(0, 4)", "empty", "at most V ranks"],
    ),
    "target_shape": (
        _lm_head(target=TARGET[:, :2]),
        ValueError,
        ["(2, 2)", "leading shape (2, 3)", "+ (K,) for K ids per position"],
    ),
    "ignore_index_tensor": (
        _lm_head(ignore_index=torch.tensor(3)),
        TypeError,
        ["ignore_index", "Python int", "tensor(3)"],
    ),
    "ignore_index_float": (
        _lm_head(ignore_index=3.0),
        TypeError,
        ["ignore_index", "must be an int", "3.0"],
    ),
    "ignore_index_wraps_int32_target": (
        _lm_head(target=TARGET.int(), ignore_index=2**32),
        ValueError,
        ["ignore_index=4294967296", "torch.int32", "target.long()"],
    ),
    "vocab_start_float": (_lm_head(vocab_start=2.0), TypeError, ["vocab_start", "int", "2.0"]),
    "vocab_start_bool": (_lm_head(vocab_start=True), TypeError, ["vocab_start", "True"]),
    "vocab_start_negative": (_lm_head(vocab_start=-1), ValueError, ["vocab_start", ">= 0", "-1"]),
    "chunk_size_float": (_lm_head(chunk_size=2.5), TypeError, ["chunk_size", "int", "2.5"]),
    "chunk_size_bool": (_lm_head(chunk_size=True), TypeError, ["chunk_size", "True"]),
    "chunk_size_zero": (_lm_head(chunk_size=0), ValueError, ["chunk_size", ">= 1", "0"]),
    "topk_k_zero": (lambda: lm_head_topk(HIDDEN, WEIGHT, 0), ValueError, ["k must be", "[1, V_local = 5]", "0"]),
    "topk_k_above_shard": (lambda: lm_head_topk(HIDDEN, WEIGHT, 6), ValueError, ["V_local = 5", "6"]),
    "topk_k_float": (lambda: lm_head_topk(HIDDEN, WEIGHT, 2.0), TypeError, ["k", "int", "2.0"]),
    "topk_weight_shape": (
        lambda: lm_head_topk(HIDDEN, torch.randn(5, 3), 2),
        ValueError,
        ["[V_local, H] with H = 4", "(5, 3)"],
    ),
    "temperature_tensor_shape": (
        _lm_head(temperature=torch.full((3, 1), 0.7)),
        ValueError,
        ["temperature of shape (3, 1)", "does not broadcast", "(2, 3)", "one temperature per row"],
    ),
    "temperature_tensor_int": (
        _lm_head(temperature=torch.ones(2, 1, dtype=torch.long)),
        TypeError,
        ["float tensor", "torch.int64"],
    ),
    "temperature_tensor_device": (
        _lm_head(temperature=torch.ones(2, 1, device="meta")),
        ValueError,
        ["temperature is on meta", "hidden states are on cpu"],
    ),
    "temperature_tensor_requires_grad": (
        _lm_head(temperature=torch.ones(2, 1, requires_grad=True)),
        ValueError,
        ["requires grad", "temperature.detach()"],
    ),
    "temperature_tensor_zero": (
        _lm_head(temperature=torch.tensor([[0.7], [0.0]])),
        RuntimeError,
        ["temperature", "finite fp32"],
    ),
    "temperature_tensor_context_parallel_shape": (
        lambda: lm_head_context_parallel_logprobs(
            HIDDEN[:, :2], WEIGHT, TARGET[:, :2], temperature=torch.ones(3, 1)
        ),
        ValueError,
        ["temperature of shape (3, 1)", "does not broadcast to the output"],
    ),
    "temperature_str": (_lm_head(temperature="0.7"), TypeError, ["temperature", "float", "'0.7'"]),
    "temperature_bool": (_lm_head(temperature=True), TypeError, ["temperature", "True"]),
    "temperature_zero": (_lm_head(temperature=0.0), ValueError, ["temperature", "0.0"]),
    "temperature_negative": (_lm_head(temperature=-1), ValueError, ["temperature", "-1"]),
    "temperature_nan": (_lm_head(temperature=float("nan")), ValueError, ["temperature", "nan"]),
    "temperature_inf": (_lm_head(temperature=float("inf")), ValueError, ["temperature", "inf"]),
    "temperature_huge_int": (
        _lm_head(temperature=10**400),
        ValueError,
        ["temperature", "fp32", "10000000000"],
    ),
    "temperature_above_fp32": (_lm_head(temperature=1e39), ValueError, ["fp32", "1e+39"]),
    "temperature_zero_in_fp32": (_lm_head(temperature=1e-50), ValueError, ["fp32", "1e-50"]),
    "temperature_reciprocal_overflows_fp32": (
        _lm_head(temperature=1e-39),
        ValueError,
        ["fp32", "1e-39"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT_CASES))
def test_bad_input_message(case):
    check_message(*BAD_INPUT_CASES[case])


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("shape", [(2, 0, 4), (0, 3, 4), (4, 2, 0, 4), (0, 4)])
def test_empty_input_is_not_an_error(shape, chunk_size):
    hidden = torch.randn(shape, requires_grad=True)
    weight = WEIGHT.clone().requires_grad_()
    target = torch.zeros(shape[:-1], dtype=torch.long)
    logprobs, entropy = lm_head_token_logprobs(
        hidden, weight, target, chunk_size=chunk_size, return_entropy=True
    )
    (logprobs.sum() + entropy.sum()).backward()
    assert logprobs.shape == entropy.shape == shape[:-1]
    assert hidden.grad.shape == shape and weight.grad.shape == WEIGHT.shape


def _numpy_ints(options: dict) -> dict:
    return {name: np.int64(value) for name, value in options.items()}


def test_numpy_int_options_match_python_ints():
    """The op's schema takes Python ints only: numpy ints are converted before the call."""
    target = torch.where(TARGET == 0, IGNORE, TARGET + 3)  # this shard holds ids 3..7
    options = {"vocab_start": 3, "chunk_size": 2, "ignore_index": IGNORE}
    want = lm_head_token_logprobs(HIDDEN, WEIGHT, target, **options)
    got = lm_head_token_logprobs(HIDDEN, WEIGHT, target, **_numpy_ints(options))
    torch.testing.assert_close(got, want)


def test_context_parallel_numpy_int_options_match_python_ints():
    # vocab_start 0: the last position scores id 0 (see _cp_logprobs), which must be owned.
    options = {"vocab_start": 0, "chunk_size": 1, "ignore_index": IGNORE}
    args = (HIDDEN[:, :2], WEIGHT, TARGET[:, :2])
    want = lm_head_context_parallel_logprobs(*args, **options)
    got = lm_head_context_parallel_logprobs(*args, **_numpy_ints(options))
    torch.testing.assert_close(got, want)

def test_unshifted_targets_match_the_logits_path():
    """``next_token=False`` (each position scores its own id) through both CP entry points:
    values and gradients as the logits path's, which the CP tests check against the oracle."""
    hidden, weight = HIDDEN.double(), WEIGHT.double()
    cu = torch.tensor([0, 1, 3])  # packed: sequences of 1 and 2 positions (B = 1 row of 3)
    calls = {
        "plain": (
            lambda h, w: lm_head_context_parallel_logprobs(h, w, TARGET, next_token=False),
            lambda x: cl.context_parallel_logprobs(x, TARGET, next_token=False),
        ),
        "packed": (
            lambda h, w: lm_head_packed_context_parallel_logprobs(
                h[:1], w, TARGET[:1], cu, max_seqlen=3, next_token=False
            ),
            lambda x: cl.packed_context_parallel_logprobs(
                x[:1], TARGET[:1], cu, max_seqlen=3, next_token=False
            ),
        ),
    }
    for name, (from_hidden, from_logits) in calls.items():
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        got = from_hidden(*leaves)
        got_grads = torch.autograd.grad(got.sum(), leaves)
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        want = from_logits(leaves[0] @ leaves[1].T)
        want_grads = torch.autograd.grad(want.sum(), leaves)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got, want, msg=name)
        for got_grad, want_grad in zip(got_grads, want_grads):
            torch.testing.assert_close(got_grad, want_grad, msg=name)


# --- context parallelism: hidden states sharded like the logits of the CP entry points ---

CP_GRIDS = [(1, 2), (2, 2)]  # (tp, cp)
PACKED_LENS = (8, 12, 4)  # padded sequence lengths, multiples of 2 * cp
CP_CASES = [
    Case(seq=16),  # input_ids hold 15 of the 16 padded positions
    Case(lead=(1,), seq=sum(PACKED_LENS), dtype="bf16", ignore=True, temperature=0.7, chunk=3),
    Case(seq=16, ignore=True, temperature="rows"),  # one temperature per row, as a tensor
]
_MESHES: dict[tuple[int, int], object] = {}


def _ref_shard(x: torch.Tensor, rank: int, size: int, dim: int, lens=None) -> torch.Tensor:
    """The load-balanced CP shard by chunk-and-concat, of each of the packed sequences
    ``lens`` on its own (``None``: one sequence)."""
    parts = [x] if lens is None else x.split(lens, dim)
    shards = []
    for part in parts:
        chunks = part.chunk(2 * size, dim)
        shards += [chunks[rank], chunks[2 * size - 1 - rank]]
    return torch.cat(shards, dim)


def _cp_upstream(case: Case, shape) -> tuple[torch.Tensor, torch.Tensor]:
    up = torch.randn(2, *shape, generator=torch.Generator().manual_seed(case.seed + 1), dtype=torch.float64)
    return up[0], up[1]


def _packed(case: Case) -> bool:
    return case.seq == sum(PACKED_LENS)


def _cu(device=None) -> torch.Tensor:
    return torch.tensor([0, *PACKED_LENS], device=device).cumsum(0)


def _mesh(tp: int, cp: int):
    from torch.distributed.device_mesh import init_device_mesh

    if (tp, cp) not in _MESHES:
        _MESHES[tp, cp] = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    return _MESHES[tp, cp]


def _worker_cp(
    case: Case,
    tp: int,
    cp: int,
    plain=lm_head_context_parallel_logprobs,
    packed=lm_head_packed_context_parallel_logprobs,
    check_syncs: bool = True,
) -> dict[str, torch.Tensor]:
    mesh = _mesh(tp, cp)
    tp_rank, cp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("cp")
    hidden, weight, ids, _, _ = lm_head_inputs(case)
    lo, hi = vocab_bounds(case.vocab, tp, tp_rank)
    lens = PACKED_LENS if _packed(case) else None
    hidden = _ref_shard(hidden, cp_rank, cp, -2, lens).requires_grad_()
    weight = weight[lo:hi].clone().requires_grad_()
    groups = dict(group=mesh.get_group("tp"), cp_group=mesh.get_group("cp"))
    options = dict(lm_head_options(case, lo), **groups)
    with no_host_syncs() if check_syncs else contextlib.nullcontext():
        if lens is None:
            out = plain(hidden, weight, ids[..., :-1], **options)
        else:
            out = packed(hidden, weight, ids, _cu(), max_seqlen=max(PACKED_LENS), **options)
        shape = out[0].shape if case.entropy else out.shape
        return lm_head_backward(case, out, hidden, weight, *_cp_upstream(case, shape))


def _cp_oracle(case: Case, cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """Forward: the float64 oracle of the full sequence in the output's layout. Gradients:
    the oracle of this CP rank's positions under ``cp`` times the upstream (every rank's loss
    is the same, and the CP gather's backward sums it over the CP ranks)."""
    hidden, weight, ids, _, _ = lm_head_inputs(case)
    lead, full_len = ids.shape[:-1], ids.shape[-1]
    if _packed(case):
        bounds = _cu().tolist()
        out_len = max(PACKED_LENS) - 1
        # Position p of sequence [a, b) scores ids[p + 1]; the last one scores nothing.
        segments = [(a, b - a - 1) for a, b in zip(bounds, bounds[1:])]
        lens = PACKED_LENS
    else:
        out_len = full_len - 2  # input_ids hold full_len - 1 tokens
        segments, lens = [(0, out_len)], None
    ignore = torch.full((*lead, full_len), IGNORE)
    target, positions = ignore.clone(), []
    for start, count in segments:
        target[..., start : start + count] = ids[..., start + 1 : start + count + 1]
        positions.append(torch.arange(start, start + count))
    up_lp, up_ent = _cp_upstream(case, (*lead, len(segments), out_len) if lens else (*lead, out_len))

    def to_full(per_output: torch.Tensor) -> torch.Tensor:
        rows = per_output.unsqueeze(-2) if lens is None else per_output
        full = torch.zeros(*lead, full_len, dtype=per_output.dtype)
        for row, (start, count) in zip(rows.unbind(-2), segments):
            full[..., start : start + count] = row[..., :count]
        return full

    def to_output(full: torch.Tensor) -> torch.Tensor:
        rows = [F.pad(full[..., pos], (0, out_len - len(pos))) for pos in positions]
        return rows[0] if lens is None else torch.stack(rows, -2)[0]

    whole = lm_head_oracle_of(case, hidden, weight, target, to_full(up_lp), to_full(up_ent))
    mine = lm_head_oracle_of(
        case,
        _ref_shard(hidden, cp_rank, cp, -2, lens),
        weight,
        _ref_shard(target, cp_rank, cp, -1, lens),
        cp * _ref_shard(to_full(up_lp), cp_rank, cp, -1, lens),
        cp * _ref_shard(to_full(up_ent), cp_rank, cp, -1, lens),
    )
    return dict(mine, lp=to_output(whole["lp"]), ent=to_output(whole["ent"]), zmax=whole["zmax"])


@pytest.mark.parametrize("grid", CP_GRIDS, ids=str)
@pytest.mark.parametrize("case", CP_CASES, ids=case_id)
def test_context_parallel_matches_oracle(gloo_pool, grid, case):
    tp, cp = grid
    for rank, got in enumerate(gloo_pool(tp * cp).run(_worker_cp, case, tp, cp)):
        tp_rank, cp_rank = rank % tp, rank // tp
        check_lm_head(case, got, _cp_oracle(case, cp, cp_rank), tp_rank, tp)


def _worker_cp_compiled(seqs: tuple[int, ...]) -> int:
    """Both CP entry points compiled whole (fullgraph) equal eager, forward and backward, at
    several padded lengths (and the packed row); returns the number of graphs compiled."""
    torch._dynamo.reset()
    plain = torch.compile(lm_head_context_parallel_logprobs, fullgraph=True)
    packed = torch.compile(lm_head_packed_context_parallel_logprobs, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for case in [dataclasses.replace(CP_CASES[0], seq=seq) for seq in seqs] + CP_CASES[1:2]:
        want = _worker_cp(case, 1, 2)
        got = _worker_cp(case, 1, 2, plain, packed, check_syncs=False)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"{name} at S={case.seq}")
    return counters["stats"]["unique_graphs"] - before


def test_context_parallel_compiled_matches_eager_without_recompiles(gloo_pool):
    graphs = gloo_pool(2).run(_worker_cp_compiled, (16, 20, 28, 36))
    # At most two graphs for the plain entry point's four lengths, one for the packed row.
    assert all(count <= 3 for count in graphs), graphs
