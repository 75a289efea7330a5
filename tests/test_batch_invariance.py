"""Batch invariance: a row's log-prob, entropy and logits gradient are the same bits whatever
else is computed with it (docs/design.md, "Batch invariance").

Each check scores the same rows in several partitions (alone, inside a larger batch at
another position, in chunks, packed, sharded over TP ranks on tile boundaries and over CP
ranks) and compares the bits (NaN equal to NaN, the sign of a zero included): eager with
eager, compiled with compiled. Distributed partitions run on the session's gloo pools, each
rank comparing with the single-process result that it computes itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import DTYPES, check_sharded_property, cp_layout, ref_shard, run_example, tp_group
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import compiled_logprob as cl
from compiled_logprob._math.tiles import TILE_WIDTH
from compiled_logprob.sampler import sampler_logprobs

# A vocabulary of whole tiles and a narrower last one.
VOCAB = 3 * TILE_WIDTH + 100


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    same = (actual == expected) & (actual.signbit() == expected.signbit())
    same = same | (actual.isnan() & expected.isnan())
    if not bool(same.all()):
        diff = (actual.double() - expected.double()).abs().nan_to_num().max().item()
        raise AssertionError(f"{what}: {int((~same).sum())} entries differ (max {diff:.3g})")


# Each API: (logits [B, S, V], target [B, S], temperature [B, S]) -> outputs [B, S, *]; the
# gradient is of the sum of the outputs (NaN- and inf-free ones), per row.
def _k_ids(target: torch.Tensor) -> torch.Tensor:
    """Three ids per position, one repeated, inside every vocabulary of the cases."""
    return torch.stack([target, (target * 7 + 1) % 5, target], dim=-1)


APIS = {
    "token_logprobs": lambda x, t, temp, **o: [cl.token_logprobs(x, t, temperature=temp, **o)],
    "entropy": lambda x, t, temp, **o: list(
        cl.token_logprobs(x, t, temperature=temp, return_entropy=True, **o)
    ),
    "k_ids": lambda x, t, temp, **o: [cl.token_logprobs(x, _k_ids(t), **o)],
    "logsumexp": lambda x, t, temp, vocab_start=0, **o: [
        cl.vocab_parallel_logsumexp(x, temperature=temp, **o)
    ],
    "vocab_entropy": lambda x, t, temp, vocab_start=0, **o: [cl.vocab_parallel_entropy(x, **o)],
    "topk": lambda x, t, temp, **o: [cl.vocab_parallel_topk(x, 3, **o)[0]],
    "log_softmax": lambda x, t, temp, vocab_start=0, **o: [cl.vocab_parallel_log_softmax(x, **o)],
    "filtered": lambda x, t, temp, **o: [
        cl.token_logprobs(x, t, temperature=temp, top_k=20, top_p=0.9, **o)
    ],
}


def _results(forward, logits, target, temperature, **options) -> list[torch.Tensor]:
    """``forward``'s outputs (an :data:`APIS` entry, maybe compiled) and the gradient of
    their (finite) sum w.r.t. the logits."""
    logits = logits.detach().requires_grad_(True)
    outputs = forward(logits, target, temperature, **options)
    loss = sum(torch.where(o.isfinite(), o, 0.0).sum() for o in outputs)
    (grad,) = torch.autograd.grad(loss, logits, allow_unused=True, materialize_grads=True)
    return [*outputs, grad]


def _rows(results: list[torch.Tensor], b: slice, s: slice) -> list[torch.Tensor]:
    return [r[b, s] for r in results]


def _inputs(
    seed: int, batch: int, seq: int, vocab: int, dtype, scale: float, padding: int,
    device: str = "cpu",
):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen) * scale
    if padding:
        logits[..., vocab - padding :] = -torch.inf  # vocabulary padding
    target = torch.randint(0, vocab - padding, (batch, seq), generator=gen)
    temperature = 0.5 + torch.rand(batch, seq, generator=gen)
    return logits.to(device, dtype), target.to(device), temperature.to(device)


@dataclasses.dataclass
class Case:
    api: str
    dtype: str
    vocab: int
    batch: int
    seq: int
    scale: float
    padding: int
    seed: int
    chunk: int | None = None  # the sharded call's chunk_size (check_tp_case)


_cases = st.builds(
    Case,
    api=st.sampled_from(sorted(APIS)),
    dtype=st.sampled_from(sorted(DTYPES)),
    vocab=st.sampled_from([7, 1003, TILE_WIDTH, VOCAB]),
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    scale=st.sampled_from([1.0, 1000.0]),
    padding=st.sampled_from([0, 5]),
    seed=st.integers(0, 2**16),
)


def check_partitions(case: Case, device: str = "cpu") -> None:
    """The case's rows scored in one batch, one row at a time, after other rows, and in
    chunks of one position: the same bits."""
    logits, target, temperature = _inputs(
        case.seed, case.batch, case.seq, case.vocab, DTYPES[case.dtype], case.scale,
        min(case.padding, case.vocab - 1), device,
    )
    forward = APIS[case.api]
    whole = _results(forward, logits, target, temperature)
    chunked = _results(forward, logits, target, temperature, chunk_size=1)
    other, other_target, other_temperature = _inputs(
        case.seed + 1, case.batch, 2, case.vocab, DTYPES[case.dtype], 1.0, 0, device
    )
    after = _results(
        forward,
        torch.cat([other, logits], 1),
        torch.cat([other_target, target], 1),
        torch.cat([other_temperature, temperature], 1),
    )
    for b in range(case.batch):
        for s in range(case.seq):
            alone = _results(
                forward, logits[b : b + 1, s : s + 1], target[b : b + 1, s : s + 1],
                temperature[b : b + 1, s : s + 1],
            )
            where = slice(b, b + 1), slice(s, s + 1)
            for name, results, at in [
                ("in the batch", whole, where),
                ("in chunks", chunked, where),
                ("after other rows", after, (where[0], slice(s + 2, s + 3))),
            ]:
                for i, (got, want) in enumerate(zip(_rows(results, *at), alone, strict=True)):
                    assert_same_bits(got, want, f"{case} output {i} {name}")


@settings(max_examples=60, deadline=None)
@given(_cases)
def test_a_row_is_the_same_bits_in_any_batch_eager(case: Case):
    check_partitions(case)


# ---------------------------------------------------------------------------------------
# Compiled: each shape gets its own kernels (dynamic=False), or one kernel serves them all.


def check_row_counts(dynamic: bool, dtype: str, device: str = "cpu") -> None:
    """Rows scored by the kernels compiled for 18 rows and for one: the same bits."""
    torch._dynamo.reset()
    compiled = torch.compile(APIS["entropy"], fullgraph=True, dynamic=dynamic)
    logits, target, temperature = _inputs(0, 2, 9, VOCAB, DTYPES[dtype], 3.0, 0, device)
    whole = _results(compiled, logits, target, temperature)
    for b, s in [(0, 0), (1, 4), (1, 8)]:
        alone = _results(
            compiled,
            logits[b : b + 1, s : s + 1], target[b : b + 1, s : s + 1],
            temperature[b : b + 1, s : s + 1],
        )
        for i, (got, want) in enumerate(zip(_rows(whole, slice(b, b + 1), slice(s, s + 1)), alone)):
            assert_same_bits(got, want, f"compiled output {i}, row {b, s}")


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compiled_for_other_row_counts_give_the_same_bits(dynamic, dtype):
    check_row_counts(dynamic, dtype)


@pytest.mark.parametrize("api", ["log_softmax", "topk", "filtered", "k_ids"])
def test_compiled_entry_points_are_batch_invariant(api):
    torch._dynamo.reset()
    compiled = torch.compile(APIS[api], fullgraph=True)
    logits, target, temperature = _inputs(1, 1, 7, VOCAB, torch.float32, 3.0, 0)
    whole = _results(compiled, logits, target, temperature)
    alone = _results(compiled, logits[:, 3:4], target[:, 3:4], temperature[:, 3:4])
    for i, (got, want) in enumerate(zip(_rows(whole, slice(0, 1), slice(3, 4)), alone)):
        assert_same_bits(got, want, f"compiled {api} output {i}")


# ---------------------------------------------------------------------------------------
# Packed rows and hidden states, in one process.


def test_packed_sequences_score_as_each_one_alone():
    logits, ids, _ = _inputs(2, 1, 16, VOCAB, torch.bfloat16, 3.0, 0)
    cu = torch.tensor([0, 6, 10, 16])
    packed = cl.packed_context_parallel_logprobs(logits, ids, cu, max_seqlen=6)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = cl.token_logprobs(logits[:, start : end - 1], ids[:, start + 1 : end])
        assert_same_bits(packed[i, : end - start - 1], alone[0], f"sequence {i}")


def _hidden_results(hidden, weight, target, **options) -> list[torch.Tensor]:
    """Log-probs, entropy and the gradient of their sum w.r.t. the hidden states."""
    hidden = hidden.detach().requires_grad_(True)
    outputs = cl.lm_head_token_logprobs(hidden, weight, target, return_entropy=True, **options)
    (grad,) = torch.autograd.grad(sum(o.sum() for o in outputs), hidden)
    return [*outputs, grad]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hidden_state_rows_are_the_same_bits_in_any_batch(dtype):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 64, generator=gen).to(DTYPES[dtype])
    weight = (torch.randn(VOCAB, 64, generator=gen) / 8).to(DTYPES[dtype])
    target = torch.randint(0, VOCAB, (2, 9), generator=gen)
    whole = _hidden_results(hidden, weight, target)
    chunked = _hidden_results(hidden, weight, target, chunk_size=2)
    for b, s in [(0, 0), (1, 5), (1, 8)]:
        where = slice(b, b + 1), slice(s, s + 1)
        alone = _hidden_results(hidden[where], weight, target[where])
        for results in (whole, chunked):
            for i, (got, want) in enumerate(zip(_rows(results, *where), alone, strict=True)):
                assert_same_bits(got, want, f"hidden states, output {i}, row {b, s}")


# ---------------------------------------------------------------------------------------
# Sharded over TP ranks (on tile boundaries) and CP ranks, on gloo.


def _tile_bounds(vocab: int, ranks: int) -> list[int]:
    """Shard starts on multiples of TILE_WIDTH, as even as whole tiles allow, and the end."""
    tiles = -(-vocab // TILE_WIDTH)
    return [min(vocab, -(-tiles * r // ranks) * TILE_WIDTH) for r in range(ranks)] + [vocab]


def check_tp_case(case: Case, group, compiled: bool = False) -> None:
    """The case's logits sharded over ``group`` on tile boundaries: the single process's
    bits, outputs and logits gradient (its shard's slice)."""
    rank, size = dist.get_rank(group), group.size()
    forward = APIS[case.api]
    if compiled:
        forward = torch.compile(forward, fullgraph=True, dynamic=False)
    # Filtering takes even shards only: 4096 ids split on tile boundaries.
    vocab = 4 * TILE_WIDTH if case.api == "filtered" else case.vocab
    logits, target, temperature = _inputs(
        case.seed, case.batch, case.seq, vocab, DTYPES[case.dtype], case.scale, case.padding
    )
    bounds = _tile_bounds(vocab, size)
    start, end = bounds[rank], bounds[rank + 1]
    sharded = _results(
        forward, logits[..., start:end], target, temperature, vocab_start=start, group=group,
        chunk_size=case.chunk,
    )
    reference = _results(forward, logits, target, temperature)
    for i, (got, want) in enumerate(zip(sharded, reference, strict=True)):
        if got.shape[-1:] != want.shape[-1:] and want.shape[-1] == vocab:
            want = want[..., start:end]  # a vocabulary-sharded output, or the gradient
        assert_same_bits(got, want, f"{case} TP {size} rank {rank} output {i}")


@st.composite
def _tp_cases(draw, world: int) -> tuple[Case, int]:
    api = draw(st.sampled_from(sorted(APIS)))
    case = Case(
        api=api,
        # Which of exactly tied logits the top-k reports may change with the sharding (its
        # values never do): bf16 ties, fp32 has none here.
        dtype="fp32" if api == "topk" else draw(st.sampled_from(sorted(DTYPES))),
        vocab=draw(st.sampled_from([VOCAB, 4 * TILE_WIDTH, 4 * TILE_WIDTH + 300])),
        batch=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, 5)),
        scale=draw(st.sampled_from([1.0, 1000.0])),
        padding=draw(st.sampled_from([0, 5])),
        seed=draw(st.integers(0, 2**16)),
        chunk=draw(st.sampled_from([None, 2])),
    )
    return case, draw(st.sampled_from([tp for tp in (2, 4) if tp <= world]))


def _check_tp_property(max_examples: int) -> None:
    # A module-level task for the workers (Hypothesis' composite strategies do not pickle).
    check_sharded_property(_tp_cases, check_tp_case, max_examples)


def test_tp_shards_on_tile_boundaries_give_the_same_bits(gloo_pool):
    """Hypothesis over APIs, dtypes, vocabularies, scales, padding, batches, chunking and the
    TP degree (2 or 4, as subgroups of 4 ranks), run inside the workers."""
    gloo_pool(4).run(_check_tp_property, 30)


def _check_compiled_tp() -> None:
    case = Case("entropy", "fp32", VOCAB, 2, 5, 3.0, 0, seed=4)
    check_tp_case(case, tp_group(2), compiled=True)


def test_compiled_tp_gives_the_compiled_single_process_bits(gloo_pool):
    gloo_pool(2).run(_check_compiled_tp)


def _check_tp_cp(tp: int, cp: int, compiled: bool) -> None:
    mesh, tp_grp, cp_grp, tp_rank, cp_rank = cp_layout(tp, cp)
    logits, ids, _ = _inputs(5, 2, 12, VOCAB, torch.bfloat16, 3.0, 0)
    bounds = _tile_bounds(VOCAB, tp)
    start, end = bounds[tp_rank], bounds[tp_rank + 1]
    local = ref_shard(logits, cp_rank, cp, 1)[..., start:end]
    score, score_packed, score_dtensor = (
        cl.context_parallel_logprobs, cl.packed_context_parallel_logprobs, cl.dtensor_logprobs
    )
    if compiled:
        score, score_packed, score_dtensor = (
            torch.compile(f, fullgraph=True, dynamic=False)
            for f in (score, score_packed, score_dtensor)
        )
    got = score(
        local, ids, vocab_start=start, group=tp_grp, cp_group=cp_grp, chunk_size=2,
        return_entropy=True,
    )
    want = cl.token_logprobs(logits[:, :-1], ids[:, 1:], return_entropy=True)
    if compiled:
        want = torch.compile(cl.token_logprobs, fullgraph=True)(
            logits[:, :-1], ids[:, 1:], return_entropy=True
        )
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"TP {tp} x CP {cp} output {i}")
    if compiled:
        return  # the sampler below is eager
    cu = torch.tensor([0, 4, 12])  # two sequences, lengths multiples of 2 * CP
    packed = score_packed(
        torch.cat([ref_shard(logits[0, s:e], cp_rank, cp, 0) for s, e in [(0, 4), (4, 12)]])[
            None, :, start:end
        ],
        ids[:1],
        cu,
        max_seqlen=8,
        vocab_start=start,
        group=tp_grp,
        cp_group=cp_grp,
        chunk_size=3,
    )
    for i, (s, e) in enumerate([(0, 4), (4, 12)]):
        alone = sampler_logprobs(logits[0, s : e - 1], ids[0, s + 1 : e])
        assert_same_bits(packed[i, : e - s - 1], alone, f"TP {tp} x CP {cp} packed sequence {i}")
    # DTensor shards the vocabulary as torch.chunk does: 4096 ids split on tile boundaries;
    # the sequence in a permuted order (seq_index), the target a DTensor like the logits.
    wide, wide_ids, _ = _inputs(7, 2, 12, 4 * TILE_WIDTH, torch.bfloat16, 3.0, 0)
    seq_index = torch.randperm(12, generator=torch.Generator().manual_seed(7))
    sharded = distribute_tensor(wide[:, seq_index], mesh, [Shard(1), Shard(2)])
    target = distribute_tensor(wide_ids[:, seq_index], mesh, [Shard(1), Replicate()])
    got = score_dtensor(sharded, target, seq_index=seq_index, return_entropy=True)
    want = cl.token_logprobs(wide[:, :-1], wide_ids[:, 1:], return_entropy=True)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"DTensor TP {tp} x CP {cp} output {i}")


@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2)])
def test_tp_and_cp_give_the_single_process_bits(gloo_pool, tp, cp):
    gloo_pool(tp * cp).run(_check_tp_cp, tp, cp, False)


def test_compiled_tp_and_cp_give_the_compiled_single_process_bits(gloo_pool):
    gloo_pool(4).run(_check_tp_cp, 2, 2, True)


def _check_tp_hidden(tp: int) -> None:
    group = tp_group(tp)
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 5, 64, generator=gen)
    weight = torch.randn(VOCAB, 64, generator=gen) / 8
    target = torch.randint(0, VOCAB, (2, 5), generator=gen)
    bounds = _tile_bounds(VOCAB, tp)
    start, end = bounds[rank], bounds[rank + 1]
    got = cl.lm_head_token_logprobs(
        hidden, weight[start:end], target, vocab_start=start, group=group, return_entropy=True
    )
    want = cl.lm_head_token_logprobs(hidden, weight, target, return_entropy=True)
    # The hidden states' gradient sums the shards' parts in floating point: not compared.
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"hidden states TP {tp} rank {rank} output {i}")


def test_hidden_states_over_tp_give_the_single_process_bits(gloo_pool):
    gloo_pool(2).run(_check_tp_hidden, 2)


# ---------------------------------------------------------------------------------------
# The engine's side.


def test_sampler_logprobs_matches_the_trainer_bits_one_request_at_a_time():
    logits, ids, temperature = _inputs(6, 2, 7, VOCAB, torch.bfloat16, 3.0, 0)
    trainer = cl.token_logprobs(logits, ids, temperature=temperature, chunk_size=3)
    for b in range(2):
        for s in range(7):
            engine = sampler_logprobs(
                logits[b, s : s + 1], ids[b, s : s + 1], temperature=temperature[b, s : s + 1]
            )
            assert_same_bits(engine, trainer[b, s : s + 1], f"request {b, s}")


def test_sampler_logprobs_wants_one_row_per_request():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sampler_logprobs(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long))


def test_the_on_policy_example_agrees_to_the_bit():
    """examples/on_policy.py: a TP = 2 x CP = 2 trainer and a token-by-token sampler."""
    assert "bit for bit" in run_example("on_policy.py", timeout=120)
