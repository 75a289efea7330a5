"""Every rank reaches the same verdict: a distributed call returns correct values on every
rank, or raises the same clear error on every rank, never a hang or a silently wrong value.

Each case runs on 2 gloo ranks whose inputs differ where the case says, under a hard
deadline (a hang fails the case and restarts the pool); each rank reports what it got, and
the test asserts that all ranks report the same. The checks here are the free ones, which
travel in the call's own collectives (docs/distributed.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import compiled_logprob as cl
from compiled_logprob import nemo_compat
from compiled_logprob.testing.multiprocess import GlooPool, default_timeout
from compiled_logprob.testing.reference import oracle_logprobs, vocab_bounds

WORLD = 2
VOCAB = 11
SEQ = 6
IDS_DIFFER = "hold different target ids"
TEMPERATURES_DIFFER = "hold different temperatures"
NOT_OWNED = "not owned by exactly one vocabulary shard"
BAD_PACKING = "cu_seqlens_padded must start at 0"


@pytest.fixture(scope="module")
def pool():
    # A deadline per case: long enough for a compile on a busy machine, short for a hang.
    with GlooPool(WORLD, timeout=default_timeout(120)) as pool:
        yield pool


def _verdict(fn) -> tuple[str, str]:
    """``("ok", "")`` with the values checked by ``fn``, or the error's type and message."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the verdict is what we compare)
        return type(error).__name__, str(error).splitlines()[0] if str(error) else ""
    return "ok", ""


def _assert_one_verdict(verdicts: list[tuple[str, str]], expected: str) -> None:
    """Every rank reported the same: ``"ok"``, or an error whose message holds ``expected``."""
    assert len(set(verdicts)) == 1, verdicts
    kind, message = verdicts[0]
    assert (kind == "ok") if expected == "ok" else expected in message, verdicts


def _inputs(seed: int = 0):
    """This rank's shard ``[2, SEQ, V_local]`` of the same full logits, its start, and
    shared ids ``[2, SEQ]``."""
    rank = dist.get_rank()
    start, end = vocab_bounds(VOCAB, WORLD, rank)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(2, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    return full, full[..., start:end].float(), start, ids


def _tp_case(case: str, compiled: bool) -> tuple[str, str]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    full, shard, start, ids = _inputs()
    temperature: float | torch.Tensor = 1.0
    if case == "out-of-vocabulary id on one rank":
        ids[0, 0] = VOCAB if rank == 0 else VOCAB - 1
    elif case == "another valid id on one rank":
        ids[1, 2] = (ids[1, 2] + rank) % VOCAB
    elif case == "temperature tensor differs":
        temperature = torch.full((2, 1), 1.0 + rank)
    elif case == "int32 ids on one rank":
        ids = ids.int() if rank else ids

    def call(logits, target, temperature):
        return cl.token_logprobs(logits, target, vocab_start=start, group=group, temperature=temperature)

    fn = torch.compile(call, fullgraph=True) if compiled else call

    def check():
        out = fn(shard, ids, temperature)
        torch.testing.assert_close(out.double(), oracle_logprobs(full, ids.long()), atol=1e-5, rtol=0)

    return _verdict(check)


TP_CASES = {
    "out-of-vocabulary id on one rank": IDS_DIFFER,
    "another valid id on one rank": IDS_DIFFER,
    "temperature tensor differs": TEMPERATURES_DIFFER,
    "int32 ids on one rank": "ok",
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", sorted(TP_CASES))
def test_tp_ranks_agree(pool, case, compiled):
    _assert_one_verdict(pool.run(_tp_case, case, compiled), TP_CASES[case])


def _filtered_case(case: str) -> tuple[str, str]:
    """Top-k/top-p: each rank scores the rows it filters with its own ids, so ids that
    differ would give other ranks' log-probs; the ids travel back for every rank to check."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    width = 6
    full = torch.randn(2, SEQ, WORLD * width, generator=gen)
    ids = torch.randint(0, WORLD * width, (2, SEQ), generator=gen)
    if case == "ids differ":
        ids[0, 1] = (ids[0, 1] + rank) % (WORLD * width)
    shard = full[..., rank * width : (rank + 1) * width]
    return _verdict(
        lambda: cl.token_logprobs(
            shard, ids, vocab_start=rank * width, group=dist.group.WORLD, top_k=3
        )
    )


def test_filtered_ranks_agree(pool):
    _assert_one_verdict(pool.run(_filtered_case, "ids differ"), IDS_DIFFER)
    _assert_one_verdict(pool.run(_filtered_case, "same"), "ok")


def _cp_case(case: str, compiled: bool) -> tuple[str, str]:
    """CP = 2, no TP: each rank scores half the positions; a bad id at the other rank's
    positions, or a malformed copy of the packing on one rank, must stop both."""
    rank = dist.get_rank()
    cp_group = dist.group.WORLD
    gen = torch.Generator().manual_seed(2)
    seq = 8
    full = torch.randn(1, seq, VOCAB, generator=gen)
    ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    if case == "out-of-vocabulary id at one rank's positions":
        ids[0, 2] = VOCAB  # scored at position 1, which CP rank 0 holds
    shard = cl.shard_for_context_parallel(full, group=cp_group)
    if case.startswith("seq_index"):
        seq_index = torch.arange(seq)
        if rank == 1:
            seq_index[0] = 1  # not a permutation, on one rank only
        local = full[:, rank * seq // 2 : (rank + 1) * seq // 2]
        return _verdict(
            lambda: cl.context_parallel_logprobs(local, ids, cp_group=cp_group, seq_index=seq_index)
        )
    if case.startswith("distillation"):
        topk_ids = torch.stack([ids, (ids + 1) % VOCAB], dim=-1)
        topk_ids[0, 1, 1] = VOCAB  # position 1: CP rank 0's
        return _verdict(
            lambda: nemo_compat.get_distillation_topk_logprobs_from_logits(
                shard, torch.randn(topk_ids.shape), topk_ids,
                zero_outside_topk=case.endswith("full vocabulary"),
                calculate_entropy=case.endswith("full vocabulary"),
                context_parallel_group=cp_group,
            )
        )
    if case.startswith("packed"):
        cu = torch.tensor([0, 4, seq])
        if case == "packed, cu_seqlens_padded malformed on one rank" and rank == 1:
            cu = torch.tensor([0, 6, seq])
        local = torch.cat([cl.shard_for_context_parallel(full[:, a:b], group=cp_group)
                           for a, b in ((0, 4), (4, seq))], dim=1)

        def call(logits, input_ids, cu):
            return cl.packed_context_parallel_logprobs(
                logits, input_ids, cu, max_seqlen=4, cp_group=cp_group
            )

        args = (local, ids, cu)
    else:

        def call(logits, input_ids, cu):
            return cl.context_parallel_logprobs(logits, input_ids, cp_group=cp_group)

        args = (shard, ids, None)
    fn = torch.compile(call, fullgraph=True) if compiled else call
    return _verdict(lambda: fn(*args))


CP_CASES = {
    "seq_index not a permutation on one rank": "seq_index must be a permutation",
    "distillation, over the full vocabulary": NOT_OWNED,
    "distillation, over the top k": NOT_OWNED,
    "out-of-vocabulary id at one rank's positions": NOT_OWNED,
    "packed, cu_seqlens_padded malformed on one rank": BAD_PACKING,
    "packed, well formed": "ok",
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_cp_ranks_agree(pool, case, compiled):
    _assert_one_verdict(pool.run(_cp_case, case, compiled), CP_CASES[case])


def _empty_batch() -> list[tuple[int, ...]]:
    """B = 0 over a real TP group: empty results on every rank, and a backward."""
    rank = dist.get_rank()
    start, end = vocab_bounds(VOCAB, WORLD, rank)
    logits = torch.randn(0, SEQ, end - start, requires_grad=True)
    ids = torch.zeros(0, SEQ, dtype=torch.long)
    group = dist.group.WORLD
    out, entropy = cl.token_logprobs(logits, ids, vocab_start=start, group=group, return_entropy=True)
    (out.sum() + entropy.sum()).backward()
    shapes = [tuple(out.shape), tuple(logits.grad.shape)]
    shapes.append(tuple(cl.vocab_parallel_topk(logits, 2, vocab_start=start, group=group)[1].shape))
    shapes.append(tuple(nemo_compat.DistributedLogprob.apply(logits, ids, start, end, group).shape))
    return shapes


def test_empty_batch_over_a_group(pool):
    shapes = pool.run(_empty_batch)
    assert shapes[0] == [(0, SEQ), (0, SEQ, 6), (0, SEQ, 2), (0, SEQ)], shapes
    assert shapes[1][0] == (0, SEQ)


def _benign(case: str) -> tuple[str, str]:
    """Per-rank differences that must keep working: the logits' dtype, the chunk size."""
    rank = dist.get_rank()
    full, shard, start, ids = _inputs(3)
    group = dist.group.WORLD
    options: dict = {}
    if case == "bf16 vs fp64 logits":
        shard = full[..., start : start + shard.shape[-1]].to(torch.bfloat16 if rank else torch.float64)
        atol = 0.05
    else:
        options["chunk_size"] = 1 + 2 * rank
        atol = 1e-5

    def check():
        out = cl.token_logprobs(shard, ids, vocab_start=start, group=group, **options)
        torch.testing.assert_close(out.double(), oracle_logprobs(full, ids), atol=atol, rtol=0)

    return _verdict(check)


@pytest.mark.parametrize("case", ["bf16 vs fp64 logits", "chunk_size differs"])
def test_benign_differences_keep_working(pool, case):
    assert pool.run(_benign, case) == [("ok", "")] * WORLD


# --- the agreement check (COMPILED_LOGPROB_CHECK_RANKS=1 / check_ranks) ----------------------


def _disagreeing_call(case: str) -> None:
    """A call whose shapes, options or arguments differ on rank 1 only."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    full, shard, start, ids = _inputs(4)
    options: dict = {"vocab_start": start, "group": group}
    one = rank == 1
    if case == "sequence one longer":
        shard, ids = (torch.cat([shard, shard[:, :1]], 1), torch.cat([ids, ids[:, :1]], 1)) if one else (shard, ids)
    elif case == "batch one larger":
        shard, ids = (torch.cat([shard, shard[:1]]), torch.cat([ids, ids[:1]])) if one else (shard, ids)
    elif case == "K ids on one rank":
        ids = torch.stack([ids, ids], -1) if one else ids
    elif case == "return_entropy on one rank":
        options["return_entropy"] = one
    elif case == "float target on one rank":
        ids = ids.float() if one else ids
    elif case == "chunk_size=0 on one rank":
        options["chunk_size"] = 0 if one else None
    elif case == "top_k with another chunk_size":
        width = 6
        shard = full[..., rank * width : (rank + 1) * width].float()
        shard = torch.nn.functional.pad(shard, (0, width - shard.shape[-1]), value=float("-inf"))
        options = {"vocab_start": rank * width, "group": group, "top_k": 3, "chunk_size": 2 + one}
    elif case == "topk k = 4 vs 5":
        cl.vocab_parallel_topk(shard, 4 + one, vocab_start=start, group=group)
        return
    elif case in ("logits_dtype on one rank", "sequence_parallel on one rank"):
        hidden, weight = torch.randn(2, 4, 8).bfloat16(), torch.randn(6, 8).bfloat16()
        extra = (
            {"logits_dtype": torch.float32 if one else None}
            if case.startswith("logits_dtype")
            else {"sequence_parallel": one}
        )
        ids = torch.randint(0, 12, (2, 4))
        cl.lm_head_token_logprobs(hidden, weight, ids, vocab_start=6 * rank, group=group, **extra)
        return
    elif case == "context-parallel length":
        local = shard[:, : 2 + 2 * one]
        cl.context_parallel_logprobs(local, ids[:, :4], cp_group=group)
        return
    cl.token_logprobs(shard, ids, **options)


def _agreement_case(case: str) -> tuple[tuple[str, str], bool]:
    """The verdict of a disagreeing call with the check on, and whether a correct call
    works right after it (the library and the group stay usable)."""
    previous = cl.check_ranks(True)
    try:
        verdict = _verdict(lambda: _disagreeing_call(case))
        full, shard, start, ids = _inputs(5)
        out = cl.token_logprobs(shard, ids, vocab_start=start, group=dist.group.WORLD)
        usable = torch.allclose(out.double(), oracle_logprobs(full, ids), atol=1e-5)
    finally:
        cl.check_ranks(previous)
    return verdict, usable


AGREEMENT_CASES = {
    "sequence one longer": "logits differs: rank 1: [2, 7, '*'], rank 0: [2, 6, '*']",
    "batch one larger": "logits differs",
    "K ids on one rank": "target differs",
    "return_entropy on one rank": "return_entropy differs",
    "float target on one rank": "rank 1: target must hold integer token ids",
    "chunk_size=0 on one rank": "rank 1: chunk_size must be >= 1, got 0",
    "top_k with another chunk_size": "chunk_size differs",
    "topk k = 4 vs 5": "k differs",
    "context-parallel length": "logits differs",
    "logits_dtype on one rank": "logits_dtype differs",
    "sequence_parallel on one rank": "rank 1: target ((2, 4) on cpu) must have the hidden states' leading shape (2, 8)",
}


@pytest.mark.parametrize("case", sorted(AGREEMENT_CASES))
def test_agreement_check_gives_one_verdict(pool, case):
    results = pool.run(_agreement_case, case)
    verdicts = [verdict for verdict, _ in results]
    _assert_one_verdict(verdicts, AGREEMENT_CASES[case])
    assert "the ranks' calls disagree" in verdicts[0][1]
    assert all(usable for _, usable in results), results


def test_agreement_check_is_off_by_default():
    assert cl.check_ranks(False) is False


def test_agreement_check_leaves_compiled_calls_whole():
    """Compiled, the check steps aside (fullgraph, no graph break)."""
    previous = cl.check_ranks(True)
    try:
        logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
        compiled = torch.compile(lambda x, t: cl.token_logprobs(x, t), fullgraph=True)
        torch.testing.assert_close(compiled(logits, ids), cl.token_logprobs(logits, ids))
    finally:
        cl.check_ranks(previous)
