"""``lm_head_cross_entropy``: the distillation cross-entropy of two models' hidden states
against a float64 oracle, over TP, sequence parallelism and CP layouts, eager and compiled
(fullgraph, no recompiles across lengths). Its ops' opcheck cases are in
``helpers.OPCHECK_CASES``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import (
    case_id,
    lm_head_tiles,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import compiled_logprob as cl
from compiled_logprob.testing.reference import vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --- lm_head_cross_entropy: the distillation cross-entropy of two models' hidden states ---


@dataclasses.dataclass(frozen=True)
class CECase:
    dtype: str = "fp32"
    teacher_dtype: str = "fp32"
    lead: tuple[int, ...] = (2,)
    seq: int = 12
    vocab: int = 1003
    chunk: int | None = 5
    temperature: float | str = 1.0  # or "positions"
    fp32_logits: bool = False
    sequence_parallel: bool = False
    train_teacher: bool = False
    scale: float = 1.0
    seed: int = 0


CE_CASES = [
    CECase(),
    CECase(dtype="bf16", teacher_dtype="bf16", temperature="positions", chunk=None),
    CECase(dtype="bf16", teacher_dtype="fp32", fp32_logits=True, temperature=0.7),
    CECase(train_teacher=True, lead=(2, 3), seq=6, scale=30.0),
    CECase(sequence_parallel=True, train_teacher=True, temperature="positions"),
    CECase(dtype="fp16", teacher_dtype="bf16", fp32_logits=True, chunk=3),
]


def _ce_inputs(case: CECase):
    gen = torch.Generator().manual_seed(case.seed)
    shape = (*case.lead, case.seq)
    hidden = torch.randn(*shape, 16, generator=gen).to(DTYPES[case.dtype])
    weight = (torch.randn(case.vocab, 16, generator=gen) * case.scale / 2).to(DTYPES[case.dtype])
    teacher_hidden = torch.randn(*shape, 24, generator=gen).to(DTYPES[case.teacher_dtype])
    teacher_weight = (torch.randn(case.vocab, 24, generator=gen) / 2).to(DTYPES[case.teacher_dtype])
    temperature = (
        torch.linspace(0.5, 1.5, torch.Size(shape).numel()).view(shape)
        if case.temperature == "positions"
        else case.temperature
    )
    up = torch.randn(shape, generator=gen, dtype=torch.float64)
    return hidden, weight, teacher_hidden, teacher_weight, temperature, up


def _ce_oracle(case: CECase) -> dict[str, torch.Tensor]:
    """float64 cross-entropy and gradients from the product of the rounded inputs (fp32
    logits), or of that product rounded to each model's dtype."""
    *inputs, temperature, up = _ce_inputs(case)
    h, w, th, tw = (t.double().requires_grad_() for t in inputs)

    def logits(a, b, dtype):
        product = a @ b.T
        return product if case.fp32_logits else product + (product.to(dtype).double() - product).detach()

    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    x, y = logits(h, w, inputs[0].dtype), logits(th, tw, inputs[2].dtype)
    ce = -(torch.softmax(y / t, -1) * torch.log_softmax(x / t, -1)).sum(-1)
    grads = torch.autograd.grad((ce * up).sum(), [h, w, th, tw])
    return {"ce": ce.detach(), **dict(zip(("h", "w", "th", "tw"), grads)), "zmax": (x.abs().max() / min(0.5, 1.0 if isinstance(t, torch.Tensor) else t)).item()}


def _run_ce(case: CECase, rank: int, world: int, group, api=cl.lm_head_cross_entropy):
    hidden, weight, teacher_hidden, teacher_weight, temperature, up = _ce_inputs(case)
    lo, hi = vocab_bounds(case.vocab, world, rank)
    rows = slice(None)
    if case.sequence_parallel:
        part = case.seq // world
        rows = slice(rank * part, (rank + 1) * part)
    h = hidden[..., rows, :].clone().requires_grad_()
    th = teacher_hidden[..., rows, :].clone().requires_grad_(case.train_teacher)
    w, tw = weight[lo:hi].clone().requires_grad_(), teacher_weight[lo:hi].clone().requires_grad_(case.train_teacher)
    ce = api(
        h, w, th, tw, group=group, chunk_size=case.chunk, temperature=temperature,
        sequence_parallel=case.sequence_parallel,
        logits_dtype=torch.float32 if case.fp32_logits else None,
    )
    (ce.double() * up).sum().backward()
    return {"ce": ce.detach(), "h": h.grad, "w": w.grad, "th": th.grad, "tw": tw.grad}


def _check_ce(case: CECase, got: dict, want: dict, rank: int, world: int) -> None:
    lo, hi = vocab_bounds(case.vocab, world, rank)
    rows = slice(None)
    if case.sequence_parallel:
        part = case.seq // world
        rows = slice(rank * part, (rank + 1) * part)
    assert got["ce"].dtype == torch.float32
    torch.testing.assert_close(got["ce"].double(), want["ce"], rtol=0, atol=2e-5 * (1 + want["zmax"]))
    expected = {"h": want["h"][..., rows, :], "w": want["w"][lo:hi]}
    if case.train_teacher:
        expected |= {"th": want["th"][..., rows, :], "tw": want["tw"][lo:hi]}
    else:
        assert got["th"] is None and got["tw"] is None, "a frozen teacher gets no gradient"
    for name, value in expected.items():
        dtype = DTYPES[case.dtype if name in ("h", "w") else case.teacher_dtype]
        assert got[name].dtype == dtype
        scale = value.abs().max().item() + 1e-6
        err = (got[name].double() - value).abs().max().item()
        u = torch.finfo(dtype).eps
        # fp32 math: each exponential's argument off by ~ulp(|logit|), so its relative error,
        # and the gradient's where q - p cancels, grows with the logits' magnitude.
        fp32_math = 2e-5 + 2 * torch.finfo(torch.float32).eps * want["zmax"]
        assert err <= (4 * u + fp32_math) * scale, f"{name}: {err:.3g} of {scale:.3g}"


def _worker_ce(case: CECase):
    with no_host_syncs():
        return _run_ce(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("case", CE_CASES, ids=case_id)
def test_cross_entropy_matches_oracle(case):
    with no_host_syncs():
        got = _run_ce(case, 0, 1, None)
    _check_ce(case, got, _ce_oracle(case), 0, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [CE_CASES[0], CE_CASES[2], CE_CASES[4]], ids=case_id)
def test_cross_entropy_tensor_parallel_matches_oracle(gloo_pool, world, case):
    want = _ce_oracle(case)
    for rank, got in enumerate(gloo_pool(world).run(_worker_ce, case)):
        _check_ce(case, got, want, rank, world)


# Several blocks of the vocabulary per chunk (a tiny TILE_ELEMENTS): 3074 ids in blocks of
# 1024 (the last of 2), over TP 3 1025, 1025 and 1024 ids: two blocks, two, and one.
BLOCK_CASES = [
    CECase(vocab=3 * 1024 + 2, chunk=None, train_teacher=True, temperature="positions"),
    CECase(vocab=3 * 1024 + 100, dtype="bf16", teacher_dtype="bf16", chunk=5, scale=30.0),
]


def _run_ce_in_blocks(case: CECase, rank: int, world: int, group):
    with lm_head_tiles(4096), no_host_syncs():
        return _run_ce(case, rank, world, group)


def _worker_ce_blocks(case: CECase):
    return _run_ce_in_blocks(case, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_id)
def test_cross_entropy_in_vocabulary_blocks_matches_oracle(case):
    _check_ce(case, _run_ce_in_blocks(case, 0, 1, None), _ce_oracle(case), 0, 1)


def test_cross_entropy_in_vocabulary_blocks_over_tensor_parallel(gloo_pool):
    """Ranks with different numbers of blocks still gather one ``[B, S, 5]`` each."""
    case = BLOCK_CASES[0]
    want = _ce_oracle(case)
    for rank, got in enumerate(gloo_pool(3).run(_worker_ce_blocks, case)):
        _check_ce(case, got, want, rank, 3)


def test_cross_entropy_matches_the_logits_path():
    """The same values as ``vocab_parallel_cross_entropy`` of both models' logits."""
    hidden, weight, teacher_hidden, teacher_weight, temperature, _ = _ce_inputs(CE_CASES[1])
    got = cl.lm_head_cross_entropy(hidden, weight, teacher_hidden, teacher_weight, temperature=temperature)
    want = cl.vocab_parallel_cross_entropy(
        hidden @ weight.T, teacher_hidden @ teacher_weight.T, temperature=temperature
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_cross_entropy_of_context_parallel_shards_is_position_wise():
    """Each position stands alone: a load-balanced CP shard's values are the oracle's at its
    positions, whatever the layout."""
    case = CECase(seq=8)
    hidden, weight, teacher_hidden, teacher_weight, _, _ = _ce_inputs(case)
    want = _ce_oracle(case)["ce"]
    for rank in range(2):
        shard = lambda x: cl.context_parallel.shard_rank(x, rank, 2, 1)  # noqa: E731
        got = cl.lm_head_cross_entropy(shard(hidden), weight, shard(teacher_hidden), teacher_weight)
        torch.testing.assert_close(got.double(), shard(want), rtol=0, atol=1e-5)


# --- the compile contract: fullgraph, no recompiles. (No host syncs: the eager workers above
# run under no_host_syncs; compiled, the same opaque ops run.) ---


def _worker_compiled(seqs: tuple[int, ...]) -> int:
    """Compiled (fullgraph) forward and backward equal eager at several lengths; returns
    the graphs compiled."""
    torch._dynamo.reset()
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    compiled = torch.compile(cl.lm_head_cross_entropy, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for seq in seqs:
        case = CECase(seq=seq, sequence_parallel=True, train_teacher=True, temperature="positions")
        want, got = _run_ce(case, rank, world, group), _run_ce(case, rank, world, group, api=compiled)
        for name in want:
            if want[name] is not None:
                torch.testing.assert_close(got[name], want[name], msg=f"{name} at S={seq}")
    return counters["stats"]["unique_graphs"] - before


def test_compiled_matches_eager_without_recompiles(gloo_pool):
    graphs = gloo_pool(2).run(_worker_compiled, (12, 26, 40))
    assert all(count <= 2 for count in graphs), graphs


# --- bad input ---

HIDDEN, WEIGHT = torch.randn(2, 6, 8), torch.randn(50, 8)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: cl.lm_head_cross_entropy(HIDDEN, WEIGHT, HIDDEN[:, :5], WEIGHT),
         ValueError, "teacher_hidden .* must have the student's leading shape"),
        (lambda: cl.lm_head_cross_entropy(HIDDEN, WEIGHT, HIDDEN, WEIGHT[:40]),
         ValueError, "teacher_weight holds 40 vocabulary entries"),
        (lambda: cl.lm_head_cross_entropy(HIDDEN, WEIGHT, HIDDEN, WEIGHT.double()),
         TypeError, "teacher_weight .* and teacher_hidden .* must share dtype"),
        (lambda: cl.lm_head_cross_entropy(HIDDEN, WEIGHT, HIDDEN, WEIGHT, logits_dtype=torch.float16),
         ValueError, "logits_dtype must be None"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_input_names_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- a property over shapes, single process ---


@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(1, 9),
    chunk=st.one_of(st.none(), st.integers(1, 4)),
    dtype=st.sampled_from(["fp32", "bf16"]),
    fp32_logits=st.booleans(),
    temperature=st.sampled_from([1.0, 0.5, "positions"]),
    scale=st.sampled_from([1.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_matches_oracle_over_shapes(dtype, **fields):
    case = CECase(dtype=dtype, teacher_dtype=dtype, train_teacher=True, vocab=97, **fields)
    got = _run_ce(case, 0, 1, None)
    _check_ce(case, got, _ce_oracle(case), 0, 1)
