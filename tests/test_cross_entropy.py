"""The vocab-parallel soft-target cross-entropy (``vocab_parallel_cross_entropy`` and NeMo-RL's
``DistributedCrossEntropy``) against the float64 oracle, forward and both gradients.

Every rank builds the same full student and teacher logits from one seed, takes its own
``vocab_bounds`` shard of both and compares its output, and its gradients of
``sum(output · upstream)``, with the oracle's ``−Σ softmax(y / T) · log_softmax(x / T)``.
TP = 1 runs in this process with ``group=None``; TP = 2 and 3 on the session's gloo pools.

Tolerances (``_check_case``): the oracle sees the logits already rounded to their dtype, so
what is left is fp32 math on ``z = logits / T`` and the gradients' final rounding. The
cross-entropy sums ``p · (max − z)``, each term exact to a few ulps of ``|z|``; the
gradients ``(q − p) / T`` and ``p · (−log q − H) / T`` have exponentials whose arguments
carry those same ulps of ``|z|``, relative to ``p`` and ``q``.

The ops' opcheck cases are in ``helpers.OPCHECK_CASES`` (run by ``test_compile_contract``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import (
    DTYPES,
    FP32_EPS,
    assert_within,
    check_sharded_property,
    rank_and_size,
    run_cases,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import compiled_logprob as cl
from compiled_logprob.testing.reference import oracle_cross_entropy, vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

INF = float("inf")


@dataclasses.dataclass(frozen=True)
class Case:
    lead: tuple[int, ...] = (2,)
    seq: int = 13
    vocab: int = 1003
    dtype: str = "fp32"
    scale: float = 3.0
    temperature: str | None = None  # 0.7 ("float"), one per row [*lead, 1] ("row")
    chunk: int | None = None
    # "pad": the last ids -inf in both (whole shards on TP = 3); "inf_target": the teacher
    # puts mass on a -inf student logit (inf); "nan": a NaN student logit (NaN)
    special: str | None = None
    api: str = "vocab_parallel_cross_entropy"  # or "DistributedCrossEntropy"
    seed: int = 0


def _inputs(case: Case):
    """Full student and teacher logits (in the case's dtype), temperature and upstream
    gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (*case.lead, case.seq, case.vocab)
    student, teacher = case.scale * torch.randn(2, *shape, generator=gen)
    # A teacher close to the student, as in distillation, with a different argmax here and there.
    teacher = 0.5 * student + 0.5 * teacher
    if case.special == "pad":
        pad = max(1, case.vocab // 3)
        student[..., -pad:] = -INF
        teacher[..., -pad:] = -INF
    elif case.special == "inf_target":
        student[..., 0, 0] = -INF
    elif case.special == "nan":
        student[..., 0, case.vocab // 2] = float("nan")
    dtype = DTYPES[case.dtype]
    temperature = {
        None: 1.0,
        "float": 0.7,
        "row": torch.linspace(0.5, 2.0, torch.Size((*case.lead, 1)).numel()).view(*case.lead, 1),
    }[case.temperature]
    upstream = torch.randn(shape[:-1], generator=gen, dtype=torch.float64)
    return student.to(dtype), teacher.to(dtype), temperature, upstream


def _check_case(case: Case, group) -> None:
    rank, world = rank_and_size(group)
    where = f"{case} rank {rank}/{world}"
    start, end = vocab_bounds(case.vocab, world, rank)
    student, teacher, temperature, upstream = _inputs(case)
    x_full = student.double().requires_grad_()
    y_full = teacher.double().requires_grad_()
    expected = oracle_cross_entropy(x_full, y_full, temperature)
    finite = expected.isfinite()
    (torch.where(finite, expected, 0.0) * upstream).sum().backward()

    x = student[..., start:end].clone().requires_grad_()
    y = teacher[..., start:end].clone().requires_grad_()
    if case.api == "DistributedCrossEntropy":
        actual = cl.DistributedCrossEntropy.apply(x, y, group)
    else:
        actual = cl.vocab_parallel_cross_entropy(
            x, y, group=group, chunk_size=case.chunk, temperature=temperature
        )
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, where
    (torch.where(finite, actual, 0.0) * upstream.float()).sum().backward()

    t = temperature if isinstance(temperature, float) else temperature.double()
    z = student.double() / (t if isinstance(t, float) else t.unsqueeze(-1))
    z_max = torch.where(z.isfinite(), z.abs(), 0.0).amax(-1)
    ulps = 16 * FP32_EPS * (1 + z_max)
    assert_within(actual, expected, ulps * (1 + expected.abs()), f"{where}: cross-entropy")

    # Gradients: ulps of |z| relative to p and q, the fp32 subnormal step of p or q, or of
    # their product with g (times what multiplies them then), and the rounding to the
    # logits' dtype.
    info = torch.finfo(DTYPES[case.dtype])
    dtype_eps, dtype_tiny = info.eps, info.smallest_normal * info.eps  # its subnormal step
    fp32_tiny = torch.finfo(torch.float32).smallest_normal * FP32_EPS
    inverse_t = 1 / (t if isinstance(t, float) else t.unsqueeze(-1))
    g = (upstream.abs() * finite).unsqueeze(-1) * inverse_t
    p = torch.softmax(teacher.double() * inverse_t, -1).nan_to_num()
    q = torch.softmax(z, -1).nan_to_num()
    surprise = torch.where(p == 0, 0.0, -torch.log_softmax(z, -1) + expected.unsqueeze(-1))
    factor = 1 + surprise.abs() + z_max.unsqueeze(-1)
    shard = slice(start, end)
    for name, leaf, full, terms, multiplier in (
        ("logits", x, x_full, p + q, 2.0),
        ("target_logits", y, y_full, p * factor, factor),
    ):
        if case.api == "DistributedCrossEntropy" and name == "target_logits":
            assert leaf.grad is None, f"{where}: NeMo-RL gives the teacher no gradient"
            continue
        # Rows whose cross-entropy is inf or NaN have no gradient to compare (0 · inf).
        reference = torch.where(finite.unsqueeze(-1), full.grad[..., shard], 0.0)
        actual_grad = torch.where(finite.unsqueeze(-1), leaf.grad, 0.0)
        bound = (
            (g * ulps.unsqueeze(-1) * terms + (1 + g) * fp32_tiny * multiplier)[..., shard]
            + dtype_eps * reference.abs()
            + dtype_tiny
        )
        assert_within(actual_grad, reference, bound, f"{where}: grad {name}")


CASES = [
    Case(),
    Case(lead=(), seq=1, vocab=7),
    Case(lead=(2, 3), seq=5, vocab=64, dtype="bf16", temperature="row", chunk=2),
    Case(dtype="fp16", temperature="float", chunk=4),
    Case(scale=3000.0, temperature="float"),
    Case(scale=3000.0, dtype="bf16"),
    Case(special="pad", chunk=5),
    Case(special="inf_target"),
    Case(special="nan", temperature="row"),
    Case(api="DistributedCrossEntropy"),
    Case(api="DistributedCrossEntropy", dtype="bf16", special="pad"),
]


@pytest.mark.parametrize("world", (1, 2, 3))
def test_matches_oracle(gloo_pool, world):
    """Odd shapes (V = 1003 over uneven shards, S = 13, B = 1, 2-D and 4-D inputs), fp32,
    bf16, fp16, logits ×1000, -inf vocabulary padding (a whole shard at TP = 3), NaN."""
    run_cases(gloo_pool, world, _check_case, CASES)


def test_special_values():
    student = torch.tensor([[0.0, 1.0, -INF, 2.0]])
    teacher = torch.tensor([[0.0, 1.0, -INF, 2.0]])
    # Padding in both: the distribution over the other ids, whose cross-entropy with itself
    # is its entropy.
    expected = torch.distributions.Categorical(logits=student[:, [0, 1, 3]]).entropy()
    torch.testing.assert_close(cl.vocab_parallel_cross_entropy(student, teacher), expected)
    teacher_on_padding = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    assert cl.vocab_parallel_cross_entropy(student, teacher_on_padding).item() == INF
    with_nan = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])
    assert cl.vocab_parallel_cross_entropy(with_nan, teacher_on_padding).isnan().all()
    assert cl.vocab_parallel_cross_entropy(teacher_on_padding, with_nan).isnan().all()


def test_fixed_teacher_gets_no_gradient():
    student = torch.randn(2, 3, 11, requires_grad=True)
    teacher = torch.randn(2, 3, 11)
    cl.vocab_parallel_cross_entropy(student, teacher).sum().backward()
    assert student.grad is not None and teacher.grad is None
    no_graph = cl.DistributedCrossEntropy.apply(student, teacher, None, True)
    assert not no_graph.requires_grad


@settings(max_examples=60, deadline=None)
@given(
    lead=st.sampled_from([(), (1,), (3,), (2, 2)]),
    seq=st.integers(1, 17),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from(sorted(DTYPES)),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1000.0]),
    temperature=st.sampled_from([None, "float", "row"]),
    chunk=st.none() | st.integers(1, 5),
    special=st.sampled_from([None, None, "pad", "inf_target", "nan"]),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle_over_shapes(**fields):
    _check_case(Case(**fields), None)


@st.composite
def _sharded_cases(draw, world: int) -> tuple[Case, int]:
    tp = draw(st.integers(1, world))
    case = Case(
        lead=draw(st.sampled_from([(), (1,), (2, 2)])),
        seq=draw(st.integers(1, 9)),
        vocab=draw(st.integers(tp, 80)),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        scale=draw(st.sampled_from([1.0, 1000.0])),
        temperature=draw(st.sampled_from([None, "float", "row"])),
        chunk=draw(st.none() | st.integers(1, 4)),
        special=draw(st.sampled_from([None, "pad", "inf_target", "nan"])),
        seed=draw(st.integers(0, 2**16)),
    )
    return case, tp


def _check_property(max_examples: int) -> None:
    # A module-level task for the workers (Hypothesis' composite strategies do not pickle).
    check_sharded_property(_sharded_cases, _check_case, max_examples)


def test_property(gloo_pool):
    """Hypothesis over B, S, V, TP size (1-3, subgroups of 3 ranks), dtype, scale,
    temperature, chunk and special values, run inside the workers."""
    gloo_pool(3).run(_check_property, 30)


# --- host syncs, bad input -------------------------------------------------------------


def test_no_host_syncs():
    x = torch.randn(2, 5, 9, requires_grad=True)
    y = torch.randn(2, 5, 9, requires_grad=True)
    with no_host_syncs():
        out = cl.vocab_parallel_cross_entropy(x, y, chunk_size=2, temperature=torch.ones(2, 1))
        out.sum().backward()


@pytest.mark.parametrize(
    ("teacher", "message"),
    [
        (torch.randn(2, 5, 8), "must have the logits' shape (2, 5, 9)"),
        (torch.randn(2, 4, 9), "must have the logits' shape (2, 5, 9)"),
        (torch.zeros(2, 5, 9, dtype=torch.long), "target_logits must be a floating-point"),
    ],
)
def test_bad_input(teacher, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        cl.vocab_parallel_cross_entropy(torch.randn(2, 5, 9), teacher)
