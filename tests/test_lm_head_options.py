"""The hidden-state path's own options: sequence-parallel hidden states, fp32 logits from
bf16/fp16 inputs and top-k/top-p filtering, on every ``lm_head_*`` entry point; each against
the float64 oracle (or, for filtering, the logits path of the same logits, itself
oracle-tested in ``test_filtering``), eager and compiled (fullgraph, no recompiles across
lengths). The ops' opcheck cases are in ``helpers.OPCHECK_CASES``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import (
    LM_HEAD_DTYPES,
    case_id,
    check_lm_head,
    lm_head_oracle,
    run_lm_head,
)
from helpers import LMHeadCase as Case
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import compiled_logprob as cl
from compiled_logprob.testing.reference import vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --- sequence-parallel hidden states and fp32 logits, against the float64 oracle ---

SP_CASES = [
    Case(seq=12, sequence_parallel=True),
    Case(seq=12, sequence_parallel=True, dtype="bf16", ignore=True, temperature="positions", chunk=None),
    Case(seq=6, sequence_parallel=True, k=3, temperature="rows", fp32_logits=True, dtype="bf16"),
]
FP32_LOGITS_CASES = [
    Case(dtype="bf16", fp32_logits=True),
    Case(dtype="bf16", fp32_logits=True, ignore=True, temperature="positions", chunk=None),
    Case(dtype="bf16", fp32_logits=True, scale=1000.0, entropy=False),
    Case(fp32_logits=True, k=3, temperature=0.7),
]


def _worker_run(case: Case) -> dict[str, torch.Tensor]:
    with no_host_syncs():
        return run_lm_head(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("case", SP_CASES + FP32_LOGITS_CASES, ids=case_id)
def test_single_process_matches_oracle(case):
    with no_host_syncs():
        got = run_lm_head(case, 0, 1, None)
    check_lm_head(case, got, lm_head_oracle(case), 0, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", SP_CASES + FP32_LOGITS_CASES[:2], ids=case_id)
def test_tensor_parallel_matches_oracle(gloo_pool, world, case):
    """With ``sequence_parallel`` each rank passes its ``S / TP`` positions and gets back the
    gradient of exactly those: the reduce-scatter sums every rank's vocabulary slice's part."""
    want = lm_head_oracle(case)
    for rank, got in enumerate(gloo_pool(world).run(_worker_run, case)):
        check_lm_head(case, got, want, rank, world)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_fp32_logits_match_the_float64_product_of_the_inputs(dtype, scale):
    """``logits_dtype=torch.float32``: log-probs within 1e-4 of float64's, from the same
    rounded bf16/fp16 inputs; logits in the inputs' dtype are off by more."""
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(2, 9, 64, generator=gen) * scale**0.5).to(DTYPES[dtype])
    weight = (torch.randn(3001, 64, generator=gen) * scale**0.5 / 8).to(DTYPES[dtype])
    target = torch.randint(0, 3001, (2, 9), generator=gen)
    want = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    want = want.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    got = cl.lm_head_token_logprobs(hidden, weight, target, logits_dtype=torch.float32, chunk_size=4)
    assert got.dtype == torch.float32
    error = (got.double() - want).abs().max()
    assert error <= 1e-4
    rounded = cl.lm_head_token_logprobs(hidden, weight, target)
    assert (rounded.double() - want).abs().max() > 4 * error


def _worker_topk_sp():
    """``lm_head_topk`` of sequence-parallel hidden states against the replicated ones."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 8, 16, generator=gen), torch.randn(600, 16, generator=gen)
    lo, hi = vocab_bounds(600, world, rank)
    results = []
    for sequence_parallel in (False, True):
        h = (hidden[:, rank * 4 : (rank + 1) * 4] if sequence_parallel else hidden).clone().requires_grad_()
        w = weight[lo:hi].clone().requires_grad_()
        values, ids = cl.lm_head_topk(
            h, w, 5, vocab_start=lo, group=group, chunk_size=3, sequence_parallel=sequence_parallel
        )
        (values * torch.arange(5.0)).sum().backward()
        results.append((values.detach(), ids, h.grad, w.grad))
    return results, rank


def test_topk_of_sequence_parallel_hidden_states(gloo_pool):
    for (replicated, parallel), rank in gloo_pool(2).run(_worker_topk_sp):
        torch.testing.assert_close(parallel[0], replicated[0], rtol=0, atol=1e-6)
        assert torch.equal(parallel[1], replicated[1])
        torch.testing.assert_close(parallel[2], replicated[2][:, rank * 4 : (rank + 1) * 4], rtol=0, atol=1e-5)
        torch.testing.assert_close(parallel[3], replicated[3], rtol=0, atol=1e-5)


# --- top-k/top-p: the logits path's values on the same logits ---


@dataclasses.dataclass(frozen=True)
class FilterCase:
    top_k: int | None = 20
    top_p: float = 1.0
    dtype: str = "fp32"
    seq: int = 12
    chunk: int | None = 5
    temperature: float | str = 1.0  # or "positions"
    ignore: bool = False
    sequence_parallel: bool = False
    fp32_logits: bool = False


FILTER_CASES = [
    FilterCase(),
    FilterCase(top_k=None, top_p=0.8, temperature="positions"),
    FilterCase(top_k=50, top_p=0.9, dtype="bf16", ignore=True, chunk=None),
    FilterCase(top_k=7, top_p=0.95, dtype="bf16", fp32_logits=True, temperature=1.5),
    FilterCase(top_k=30, sequence_parallel=True, temperature="positions"),
]


def _filter_inputs(case: FilterCase):
    gen = torch.Generator().manual_seed(3)
    dtype = DTYPES[case.dtype]
    hidden = torch.randn(2, case.seq, 16, generator=gen).to(dtype)
    weight = (torch.randn(600, 16, generator=gen) * 0.7).to(dtype)
    # Targets among each row's most likely ids, so that most are kept, and some random ones.
    logits = (hidden.double() @ weight.double().T).float()
    top = logits.topk(5, -1).indices
    pick = torch.randint(0, 5, (2, case.seq, 1), generator=gen)
    target = torch.where(
        torch.rand(2, case.seq, generator=gen) < 0.8,
        top.gather(-1, pick).squeeze(-1),
        torch.randint(0, 600, (2, case.seq), generator=gen),
    )
    if case.ignore:
        target[:, ::3] = -100
    temperature = (
        torch.linspace(0.5, 1.5, 2 * case.seq).view(2, case.seq)
        if case.temperature == "positions"
        else case.temperature
    )
    return hidden, weight, target, temperature, torch.randn(2, case.seq, generator=gen)


def _run_filtered(case: FilterCase, rank: int, world: int, group, api=cl.lm_head_token_logprobs):
    """This rank's filtered log-probs from hidden states and from their logits (the logits
    path), with the gradients of ``Σ lp · up`` over the kept ids, as a dict."""
    hidden, weight, target, temperature, up = _filter_inputs(case)
    lo, hi = vocab_bounds(600, world, rank)
    rows = slice(None)
    if case.sequence_parallel:
        part = case.seq // world
        rows = slice(rank * part, (rank + 1) * part)
    h = hidden[:, rows].clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    options = dict(
        vocab_start=lo, group=group, chunk_size=case.chunk, temperature=temperature,
        top_k=case.top_k, top_p=case.top_p, ignore_index=-100 if case.ignore else None,
    )
    got = api(
        h, w, target, sequence_parallel=case.sequence_parallel,
        logits_dtype=torch.float32 if case.fp32_logits else None, **options,
    )
    torch.where(got.isinf(), 0.0, got * up).sum().backward()
    # The logits path on the product that the hidden-state path forms, per row alike.
    product_dtype = torch.float32 if case.fp32_logits else hidden.dtype
    logits = (hidden.to(product_dtype) @ weight[lo:hi].to(product_dtype).T).requires_grad_()
    want = cl.token_logprobs(logits, target, **options)
    torch.where(want.isinf(), 0.0, want * up).sum().backward()
    grad_logits = logits.grad.double()
    return {
        "got": got.detach(), "want": want.detach(), "rows": rows,
        "grad_h": h.grad, "grad_h_part": grad_logits @ weight[lo:hi].double(),
        "grad_w": w.grad, "want_grad_w": grad_logits.flatten(0, 1).T @ hidden.double().flatten(0, 1),
    }


def _check_filtered(case: FilterCase, results: list[dict]) -> None:
    u = torch.finfo(DTYPES[case.dtype]).eps
    # Each rank's logits gradient covers its vocabulary slice: the hidden states' is the sum.
    grad_h = sum(r["grad_h_part"] for r in results)
    for rank, r in enumerate(results):
        assert torch.equal(r["got"].isinf(), r["want"].isinf()), "filtered out alike"
        kept = ~r["want"].isinf()
        assert kept.float().mean() > 0.3, "the case must keep most targets"
        torch.testing.assert_close(r["got"][kept], r["want"][kept], rtol=0, atol=1e-5)
        for name, want in (("grad_h", grad_h[:, r["rows"]]), ("grad_w", r["want_grad_w"])):
            scale = want.abs().max().item() + 1e-6
            err = (r[name].double() - want).abs().max().item()
            assert err <= 4 * u * scale + 1e-5, f"rank {rank} {name}: {err:.3g} of {scale:.3g}"


def _worker_filtered(case: FilterCase):
    with no_host_syncs():
        return _run_filtered(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("case", FILTER_CASES, ids=case_id)
def test_filtered_matches_the_logits_path(case):
    _check_filtered(case, [_run_filtered(case, 0, 1, None)])


@pytest.mark.parametrize("case", FILTER_CASES[:4], ids=case_id)
def test_filtered_tensor_parallel_matches_the_logits_path(gloo_pool, case):
    _check_filtered(case, gloo_pool(2).run(_worker_filtered, case))


def _run_cp_filtered(packed_row: bool, rank: int, world: int, group):
    """The context-parallel entry points with top-k/top-p and sequence-parallel hidden
    states, against the logits entry point on the same logits (CP of one rank)."""
    case = FilterCase(top_k=25, top_p=0.9, seq=8)
    hidden, weight, ids, _, _ = _filter_inputs(case)
    lo, hi = vocab_bounds(600, world, rank)
    part = case.seq // world
    options = dict(vocab_start=lo, group=group, top_k=case.top_k, top_p=case.top_p, chunk_size=3)
    logits = hidden @ weight[lo:hi].T
    if packed_row:  # two sequences of 4 packed in one row
        cu = torch.tensor([0, 4, 8])
        flat = lambda x: x.flatten(0, 1)[:8].unsqueeze(0)  # noqa: E731
        hidden, logits, ids = flat(hidden), flat(logits), flat(ids)
        extra = dict(cu_seqlens_padded=cu, max_seqlen=4)
        api, reference = cl.lm_head_packed_context_parallel_logprobs, cl.packed_context_parallel_logprobs
    else:
        extra = {}
        api, reference = cl.lm_head_context_parallel_logprobs, cl.context_parallel_logprobs
    mine = hidden[:, rank * part : (rank + 1) * part] if not packed_row else hidden[:, rank * 4 : (rank + 1) * 4]
    got = api(mine, weight[lo:hi], ids, sequence_parallel=True, **extra, **options)
    return got, reference(logits, ids, **extra, **options)


def _worker_cp_filtered(packed_row: bool):
    with no_host_syncs():
        return _run_cp_filtered(packed_row, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("packed_row", [False, True])
def test_context_parallel_entry_points_filter_sequence_parallel_hidden_states(gloo_pool, packed_row):
    for got, want in gloo_pool(2).run(_worker_cp_filtered, packed_row):
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --- the compile contract of the new options: fullgraph, no recompiles. (No host syncs: the
# eager workers above run under no_host_syncs; compiled, the same opaque ops run.) ---


def _worker_compiled(kind: str, seqs: tuple[int, ...]) -> int:
    """Compiled (fullgraph) forward and backward equal eager at several lengths; returns
    the graphs compiled."""
    torch._dynamo.reset()
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    before = counters["stats"]["unique_graphs"]
    for seq in seqs:
        if kind == "filtered":
            case = FilterCase(top_k=30, top_p=0.9, seq=seq, sequence_parallel=True, fp32_logits=True, dtype="bf16")
            compiled = torch.compile(cl.lm_head_token_logprobs, fullgraph=True)
            want = _run_filtered(case, rank, world, group)
            got = _run_filtered(case, rank, world, group, api=compiled)
            want, got = {k: want[k] for k in ("got", "grad_h", "grad_w")}, {k: got[k] for k in ("got", "grad_h", "grad_w")}
        else:
            case = Case(seq=seq, sequence_parallel=True, fp32_logits=True, dtype="bf16", ignore=True, temperature="positions")
            compiled = torch.compile(cl.lm_head_token_logprobs, fullgraph=True)
            want, got = run_lm_head(case, rank, world, group), run_lm_head(case, rank, world, group, api=compiled)
        for name in want:
            if want[name] is not None:
                torch.testing.assert_close(got[name], want[name], msg=f"{kind} {name} at S={seq}")
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("kind", ["logprobs", "filtered"])
def test_compiled_matches_eager_without_recompiles(gloo_pool, kind):
    graphs = gloo_pool(2).run(_worker_compiled, kind, (12, 26, 40))
    assert all(count <= 2 for count in graphs), graphs


# --- bad input ---

HIDDEN, WEIGHT, TARGET = torch.randn(2, 6, 8), torch.randn(50, 8), torch.randint(0, 50, (2, 6))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: cl.lm_head_token_logprobs(HIDDEN, WEIGHT, TARGET, logits_dtype=torch.float64),
         ValueError, "logits_dtype must be None"),
        (lambda: cl.lm_head_token_logprobs(HIDDEN, WEIGHT, TARGET, sequence_parallel=1),
         TypeError, "sequence_parallel must be a bool"),
        (lambda: cl.lm_head_token_logprobs(HIDDEN, WEIGHT, TARGET, top_k=5, return_entropy=True),
         ValueError, "return_entropy is not supported with top_k/top_p"),
        (lambda: cl.lm_head_token_logprobs(HIDDEN, WEIGHT, TARGET, top_p=1.5),
         ValueError, r"top_p must be in \(0, 1\]"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_input_names_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _worker_sp_wrong_length():
    try:
        cl.lm_head_token_logprobs(HIDDEN, WEIGHT, TARGET, group=dist.group.WORLD, sequence_parallel=True)
    except ValueError as error:
        return str(error)
    return None


def test_sequence_parallel_target_must_cover_the_whole_sequence(gloo_pool):
    """Every rank passes S / TP positions of hidden states and the whole sequence's targets:
    the targets of only S / TP positions (checked on the replicated shapes) fail alike."""
    for message in gloo_pool(2).run(_worker_sp_wrong_length):
        assert message is not None and "(2, 12)" in message


# --- a property over the options, single process ---


@settings(max_examples=60, deadline=None)
@given(
    seq=st.integers(1, 13),
    vocab=st.integers(2, 600),
    dtype=st.sampled_from(sorted(LM_HEAD_DTYPES)),
    chunk=st.one_of(st.none(), st.integers(1, 6)),
    temperature=st.sampled_from([1.0, 0.3, "positions"]),
    scale=st.sampled_from([1.0, 1000.0]),
    entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp32_logits_match_oracle_over_shapes(**fields):
    case = Case(fp32_logits=True, **fields)
    with no_host_syncs():
        got = run_lm_head(case, 0, 1, None)
    check_lm_head(case, got, lm_head_oracle(case), 0, 1)
