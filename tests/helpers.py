"""What more than one test module uses, in one place: test modules import this module, the
conftest fixtures, the package and third-party libraries, never one another.

* The dtypes, ``ignore_index`` and fp32 constants of the oracle tests, and their
  elementwise tolerance check (:func:`assert_within`).
* Running a module's ``check_case(case, group)`` on TP = 1 in this process or on the
  session's gloo pools (:func:`run_cases`), in a Hypothesis property on TP subgroups
  (:func:`check_sharded_property`), or compiled (:func:`compiled_per_case`).
* The context-parallel layout: a ``("cp", "tp")`` mesh per process (:func:`cp_layout`) and
  the load-balanced CP shard by chunk-and-concat (:func:`ref_shard`,
  :func:`ref_shard_packed`), independent of the library's index maps.
* NeMo-RL's sampling parameters and the check of an error's message.
* The oracle cases that ``test_device`` runs on a GPU as well as their own modules on the
  CPU, each a case dataclass, our call (``*_ours``, which the device tests move) and the
  check against the float64 oracle (``check_*_case(case, group, run_ours)``):
  :class:`NumericsCase` (``test_tp_numerics``), :class:`ExtrasCase` (``test_extras``),
  :class:`FilterCase` (``test_filtering``); and ``test_lm_head``'s :class:`LMHeadCase`,
  with :func:`run_lm_head`, :func:`lm_head_oracle` and :func:`check_lm_head`.
* :data:`OPCHECK_CASES`: the ``torch.library.opcheck`` cases of every custom op, by its
  qualified name; ``test_compile_contract`` runs them all and compares the names with the
  ops the package registers.
  Test ids name every case class ``Case`` (:func:`case_id`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import compiled_logprob as cl
from compiled_logprob._math.topk import TOPK_BLOCK
from compiled_logprob._ops import lm_head as lm_head_ops
from compiled_logprob.lm_head import lm_head_token_logprobs
from compiled_logprob.testing.multiprocess import default_timeout, property_in_lockstep
from compiled_logprob.testing.reference import (
    oracle_entropy,
    oracle_filtered_log_softmax,
    oracle_log_softmax,
    oracle_logprobs,
    oracle_logsumexp,
    oracle_topk,
    vocab_bounds,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE = -100
FP32_EPS = torch.finfo(torch.float32).eps
FP32_TINY = torch.finfo(torch.float32).smallest_normal * FP32_EPS  # the subnormal step


# ---------------------------------------------------------------------------------------
# Tolerances and the runners of the oracle tests' cases


def assert_within(actual, expected, bound, what: str) -> None:
    """``|actual - expected| <= bound`` elementwise; NaN and ±inf must sit at the same places."""
    actual, expected = actual.double(), expected.double()
    both_nan = actual.isnan() & expected.isnan()
    ok = (actual == expected) | ((actual - expected).abs() <= bound) | both_nan
    if not ok.all():
        bad = tuple((~ok).nonzero()[0].tolist())
        bound = bound.expand_as(expected)
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements off; first at {bad}: "
            f"ours {actual[bad].item()!r}, oracle {expected[bad].item()!r}, "
            f"bound {bound[bad].item()!r}"
        )


def rank_and_size(group) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` for ``group=None``."""
    return (0, 1) if group is None else (dist.get_rank(group), group.size())


def compiled_per_case(ours):
    """A test module's ``_ours(case, shard, target, start, group, option)`` under
    ``torch.compile(fullgraph=True)``, compiled afresh for each call's case and with no
    cached artifact (one of another form of the same graph would stand in for it)."""

    def call(case, shard, target, start, group, option):
        def run(shard, target, option):
            return ours(case, shard, target, start, group, option)

        torch._dynamo.reset()
        with torch.compiler.config.patch(force_disable_caches=True):
            return torch.compile(run, fullgraph=True)(shard, target, option)

    return call


# The world's ranks split into consecutive groups of each TP size (the last one possibly
# smaller), created once per worker: new_group is collective, so every rank makes every group.
_TP_GROUPS: dict[int, dist.ProcessGroup] = {}


def tp_group(tp: int) -> dist.ProcessGroup:
    """This rank's TP subgroup of size ``tp`` (a worker's; the groups are made on first use)."""
    if not _TP_GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        for size in range(1, world + 1):
            for first in range(0, world, size):
                ranks = list(range(first, min(first + size, world)))
                group = dist.new_group(ranks)
                if rank in ranks:
                    _TP_GROUPS[size] = group
    return _TP_GROUPS[tp]


def _check_in_world_group(check_case, cases: list) -> None:
    """``check_case(case, group)`` for each case, on the world group (a pool's worker task),
    or with ``group=None`` where torch.distributed is not initialised."""
    group = dist.group.WORLD if dist.is_initialized() else None
    for case in cases:
        check_case(case, group)


def run_cases(gloo_pool, world: int, check_case, cases: list) -> None:
    """:func:`_check_in_world_group` on ``world`` ranks: TP = 1 in this process (no
    torch.distributed), else on the session's gloo pool of that size."""
    if world == 1:
        _check_in_world_group(check_case, cases)
    else:
        gloo_pool(world).run(_check_in_world_group, check_case, cases)


def check_sharded_property(cases, check_case, max_examples: int) -> None:
    """A Hypothesis property in lockstep on every rank of the pool (a worker task):
    ``cases(world_size)`` draws ``(case, tp)``, and ``check_case(case, group)`` runs on the
    pool's TP subgroup of that size."""
    property_in_lockstep(
        cases(dist.get_world_size()),
        lambda drawn: check_case(drawn[0], tp_group(drawn[1])),
        max_examples=max_examples,
    )


# ---------------------------------------------------------------------------------------
# Context parallelism: the ("cp", "tp") mesh and the load-balanced layout, by chunk-and-concat

CP_BATCH = 2  # rows of the context-parallel cases
_MESHES: dict[tuple[int, int], object] = {}


def cp_layout(tp: int, cp: int):
    """``(mesh, tp_group, cp_group, tp_rank, cp_rank)``; the mesh is built once per process."""
    if (tp, cp) not in _MESHES:
        _MESHES[tp, cp] = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    mesh = _MESHES[tp, cp]
    return (
        mesh,
        mesh.get_group("tp"),
        mesh.get_group("cp"),
        mesh.get_local_rank("tp"),
        mesh.get_local_rank("cp"),
    )


def ref_shard(x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    """This rank's load-balanced CP shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2 · size − 1 − rank`` of its ``2 · size`` chunks, concatenated."""
    if size == 1:
        return x
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim)


def ref_shard_packed(x: torch.Tensor, bounds, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a packed row ``x`` ``[T, ...]``: each padded sequence ``[s, e)`` of
    ``bounds`` load-balanced-sharded on its own, concatenated."""
    return torch.cat([ref_shard(x[s:e], rank, size, 0) for s, e in bounds])


# ---------------------------------------------------------------------------------------
# Small shared pieces


@dataclasses.dataclass
class SamplingParams:
    """NeMo-RL's ``TrainingSamplingParams``, as its drop-ins read it."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def check_message(call, error: type[Exception], substrings: list[str]) -> None:
    """``call()`` raises ``error`` with a message containing every one of ``substrings``."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    missing = [s for s in substrings if s not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def case_id(case) -> str:
    """A case's test id: its fields as ``Case(field=value, ...)``, whatever its class (the
    ids from when each test module named its own case class ``Case``)."""
    fields = (f"{f.name}={getattr(case, f.name)!r}" for f in dataclasses.fields(case) if f.repr)
    return f"Case({', '.join(fields)})"


# ---------------------------------------------------------------------------------------
# test_tp_numerics' cases: the log-prob, logsumexp and log-softmax entry points


# Outputs [..., S] (replicated on every rank): one log-prob or logsumexp per position.
TOKEN_APIS = ("token_logprobs", "DistributedLogprob", "ChunkedDistributedLogprob")
ROW_APIS = (*TOKEN_APIS, "vocab_parallel_logsumexp")
# Outputs [..., S, V_local] (sharded like the logits).
SHARDED_APIS = ("vocab_parallel_log_softmax", "_compute_distributed_log_softmax")
NUMERICS_APIS = ROW_APIS + SHARDED_APIS
NUMERICS_CHUNKABLE = (
    "token_logprobs",
    "ChunkedDistributedLogprob",
    "vocab_parallel_logsumexp",
    "vocab_parallel_log_softmax",
)


@dataclasses.dataclass(frozen=True)
class NumericsCase:
    """One input: logits ``[*lead, seq, vocab]`` of ``dtype``, ``N(0, scale²)``, seeded."""

    api: str = "token_logprobs"
    lead: tuple[int, ...] = (2,)
    seq: int = 13
    vocab: int = 1003
    dtype: str = "fp32"
    scale: float = 1.0
    chunk: int | None = None
    ignore: bool = False  # ~30% of the targets (token_logprobs only) are IGNORE
    special: str | None = None  # "inf_shard" | "nan_row"
    seed: int = 0


def numerics_inputs(case: NumericsCase, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full logits (in ``case.dtype``), targets and a float64 upstream gradient; identical on
    every rank. ``world`` places the ``inf_shard`` block on the last rank's shard exactly."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (*case.lead, case.seq, case.vocab)
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * case.scale
    logits = logits.to(DTYPES[case.dtype])
    target = torch.randint(0, case.vocab, shape[:-1], generator=gen)
    rows = logits.view(-1, case.vocab)
    if case.special == "inf_shard":
        parts = max(world, 2)
        lo, hi = vocab_bounds(case.vocab, parts, parts - 1)
        rows[::2, lo:hi] = float("-inf")  # every other row: a whole shard of -inf
        rows[:, -1] = float("-inf")  # vocabulary padding, every row
        target = target % lo  # real models never target padding
    if case.special == "nan_row":
        rows[rows.shape[0] // 2, case.vocab // 2] = float("nan")
    if case.ignore:
        target = torch.where(torch.rand(target.shape, generator=gen) < 0.3, IGNORE, target)
        if case.special == "nan_row":  # an ignored NaN row must still give 0 and no gradient
            target.view(-1)[rows.shape[0] // 2] = IGNORE
    upstream_shape = shape if case.api in SHARDED_APIS else shape[:-1]
    upstream = torch.randn(upstream_shape, generator=gen, dtype=torch.float64)
    return logits, target, upstream


def numerics_ours(case: NumericsCase, shard, target, start: int, group, ignore_index: int | None):
    end = start + shard.shape[-1]
    if case.api == "token_logprobs":
        options = dict(group=group, chunk_size=case.chunk, ignore_index=ignore_index)
        return cl.token_logprobs(shard, target, vocab_start=start, **options)
    if case.api == "DistributedLogprob":
        return cl.DistributedLogprob.apply(shard, target, start, end, group)
    if case.api == "ChunkedDistributedLogprob":
        return cl.ChunkedDistributedLogprob.apply(shard, target, start, end, case.chunk, group)
    if case.api == "vocab_parallel_logsumexp":
        return cl.vocab_parallel_logsumexp(shard, group=group, chunk_size=case.chunk)
    if case.api == "vocab_parallel_log_softmax":
        return cl.vocab_parallel_log_softmax(shard, group=group, chunk_size=case.chunk)
    return cl._compute_distributed_log_softmax(shard, group)


def _numerics_oracle(case: NumericsCase, full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if case.api in TOKEN_APIS:
        return oracle_logprobs(full, target, IGNORE if case.ignore else None)
    if case.api == "vocab_parallel_logsumexp":
        return oracle_logsumexp(full)
    return oracle_log_softmax(full)


def _numerics_value_and_grad(fn, leaf: torch.Tensor, upstream: torch.Tensor):
    leaf = leaf.detach().requires_grad_()
    out = fn(leaf)
    (grad,) = torch.autograd.grad(out, leaf, upstream.to(out.dtype))
    return out.detach(), grad


def check_numerics_case(case: NumericsCase, group, run_ours=numerics_ours) -> None:
    """Forward and backward of ``case`` on this rank's shard against the float64 oracle;
    ``run_ours`` makes our call (:func:`numerics_ours`, or it on another device or compiled)."""
    rank, world = rank_and_size(group)
    where = f"{case} rank {rank}/{world}"
    start, end = vocab_bounds(case.vocab, world, rank)
    logits, target, upstream = numerics_inputs(case, world)
    sharded = case.api in SHARDED_APIS
    local_upstream = upstream[..., start:end] if sharded else upstream
    ignore_index = IGNORE if case.ignore else None

    shard = logits[..., start:end]
    ours, grad = _numerics_value_and_grad(
        lambda x: run_ours(case, x, target, start, group, ignore_index), shard, local_upstream
    )
    # The oracle's upstream gradient is ours exactly as the autograd engine saw it.
    upstream = upstream.to(ours.dtype).double()
    ref, ref_grad = _numerics_value_and_grad(lambda x: _numerics_oracle(case, x, target), logits.double(), upstream)
    if sharded:
        ref = ref[..., start:end]
    ref_grad = ref_grad[..., start:end]

    # delta: absolute error of an fp32 logsumexp-type value (lse, log-prob, log-softmax) of
    # these logits. Subtracting the max and adding it back each cost ~1 ulp of |logits|max;
    # the sum of exps and its log cost ~log2(V) ulp of O(1) values. 1e-5 is ~80 fp32 ulps of
    # max(1, |logits|max), room for all of that plus the cross-rank combine.
    finite = torch.where(logits.isfinite(), logits.double().abs(), 0.0)
    delta = 1e-5 * max(1.0, finite.max().item())
    # Results are rounded into their dtype last: allow one ulp of it relative to the value
    # (the fp32 error can push a value across a rounding boundary).
    out_eps = torch.finfo(ours.dtype).eps
    assert_within(ours, ref, delta + out_eps * ref.abs(), f"{where} forward")

    # Gradients are g_lse * softmax + g_target * onehot. softmax = exp(z - lse) inherits
    # delta as a relative error, so each element's error is at most delta times the row's
    # upstream weight: |g| for per-row outputs, sum |G| over the vocabulary for log-softmax
    # (whose lse gradient is -sum G). Then one ulp of the gradient's dtype for the final
    # rounding, and half a subnormal step where that rounding flushes a tiny gradient.
    weight = upstream.abs().sum(-1, keepdim=True) if sharded else upstream.abs().unsqueeze(-1)
    info = torch.finfo(grad.dtype)
    grad_bound = delta * weight + info.eps * ref_grad.abs() + info.smallest_normal * info.eps / 2
    if case.ignore:
        ignored = (target == IGNORE).unsqueeze(-1)
        assert (ours.masked_select(ignored.squeeze(-1)) == 0).all(), f"{where}: log-prob not 0"
        assert (grad.masked_select(ignored) == 0).all(), f"{where}: gradient not 0 where ignored"
        # The oracle's gradient of a NaN row is NaN even where ignored; ours is exactly 0.
        ref_grad = torch.where(ignored, 0.0, ref_grad)
        plain_target = torch.where(target == IGNORE, 0, target)
        plain, plain_grad = _numerics_value_and_grad(
            lambda x: run_ours(case, x, plain_target, start, group, None), shard, local_upstream
        )
        # Every other position is bitwise what it is without ignore_index.
        kept = target != IGNORE
        assert torch.equal(ours[kept], plain[kept]), f"{where}: ignore_index changed log-probs"
        assert torch.equal(grad[kept], plain_grad[kept]), f"{where}: ignore_index changed grads"
    assert_within(grad, ref_grad, grad_bound, f"{where} gradient")


# ---------------------------------------------------------------------------------------
# test_extras' cases: temperature, entropy, K ids per position and the global top-k


EXTRAS_APIS = (
    "token_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
)


@dataclasses.dataclass(frozen=True)
class ExtrasCase(NumericsCase):
    """:class:`NumericsCase` (logits, ids, ``ignore``, ``special="inf_shard"``) and the
    extras' options; ``api`` is one of :data:`EXTRAS_APIS`."""

    temperature: str | None = None  # 0.7 ("float"), per row [*lead, 1], per position [*lead, S]
    k: int = 0  # token_logprobs: K ids per position (target [..., S, K]); topk: k
    entropy: bool = False  # token_logprobs: return_entropy


def _extras_temperature(case: ExtrasCase, gen: torch.Generator) -> float | torch.Tensor:
    if case.temperature == "float":
        return 0.7
    if case.temperature == "row":
        rows = (*case.lead, 1)
        return torch.linspace(0.5, 2.0, torch.Size(rows).numel()).view(rows)
    if case.temperature == "position":
        return 0.5 + 1.5 * torch.rand((*case.lead, case.seq), generator=gen)
    return 1.0


def _extras_inputs(case: ExtrasCase, world: int):
    """Full logits (in ``case.dtype``), ids and temperature, identical on every rank: those of
    :func:`numerics_inputs` and, for K ids, K - 1 more ids per position (the first repeated)."""
    logits, target, _ = numerics_inputs(case, world)
    gen = torch.Generator().manual_seed(case.seed + 1)
    if case.api == "token_logprobs" and case.k:
        extra = torch.randint(0, case.vocab, (*target.shape, case.k - 1), generator=gen)
        if case.special == "inf_shard":  # ids below the -inf shard, as the first one
            parts = max(world, 2)
            extra = extra % vocab_bounds(case.vocab, parts, parts - 1)[0]
        if case.ignore:
            extra = torch.where(torch.rand(extra.shape, generator=gen) < 0.3, IGNORE, extra)
        target = torch.cat([target.unsqueeze(-1), extra], -1)
        if case.k > 1:
            target[..., 1] = target[..., 0]  # a repeated id: its gradients add up
        if case.ignore:
            target.view(-1, case.k)[0] = IGNORE  # a position whose every id is ignored
    return logits, target, _extras_temperature(case, gen)


def extras_ours(case: ExtrasCase, shard, target, start: int, group, temperature) -> tuple:
    """Our outputs (fp32, differentiable) and, for top-k, the ids."""
    options = dict(group=group, chunk_size=case.chunk, temperature=temperature)
    if case.api == "token_logprobs":
        out = cl.token_logprobs(
            shard,
            target,
            vocab_start=start,
            ignore_index=IGNORE if case.ignore else None,
            return_entropy=case.entropy,
            **options,
        )
        return (out if case.entropy else (out,)), None
    if case.api == "vocab_parallel_entropy":
        return (cl.vocab_parallel_entropy(shard, **options),), None
    if case.api == "vocab_parallel_logsumexp":
        return (cl.vocab_parallel_logsumexp(shard, **options),), None
    logprobs, ids = cl.vocab_parallel_topk(shard, case.k, vocab_start=start, **options)
    return (logprobs,), ids


def _extras_ignored_rows(case: ExtrasCase, target: torch.Tensor) -> torch.Tensor:
    """``[..., S]``: positions whose every id is ignored (their entropy is 0, gradient 0)."""
    ignored = target == IGNORE
    return ignored.all(-1) if case.k else ignored


def _extras_oracle(case: ExtrasCase, full, target, temperature, ids) -> tuple:
    if case.api == "token_logprobs":
        logprobs = oracle_logprobs(full, target, IGNORE if case.ignore else None, temperature)
        if not case.entropy:
            return (logprobs,)
        entropy = oracle_entropy(full, temperature)
        if case.ignore:
            entropy = torch.where(_extras_ignored_rows(case, target), 0.0, entropy)
        return logprobs, entropy
    if case.api == "vocab_parallel_entropy":
        return (oracle_entropy(full, temperature),)
    if case.api == "vocab_parallel_logsumexp":
        return (oracle_logsumexp(full, temperature),)
    # Our ids, checked to be a top-k of the oracle's in _check_topk_ids (ties included).
    return (oracle_log_softmax(full, temperature).gather(-1, ids),)


def _extras_value_and_grad(fn, leaf: torch.Tensor, upstreams):
    leaf = leaf.detach().requires_grad_()
    outs, extra = fn(leaf)
    (grad,) = torch.autograd.grad(outs, leaf, [u.to(o.dtype) for u, o in zip(upstreams, outs)])
    return [out.detach() for out in outs], grad, extra


def _check_topk_ids(case: ExtrasCase, ids, full, temperature, where: str) -> None:
    """Our ids are distinct and the oracle's log-probs at them are its top-k values, in order:
    they are the oracle's ids wherever the top-k has no ties (bf16 rounding makes ties)."""
    values, oracle_ids = oracle_topk(full, case.k, temperature)
    assert ids.dtype == torch.int64 and ids.shape == values.shape, (where, ids.shape)
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), f"{where}: repeated top-k ids"
    at_ids = oracle_log_softmax(full, temperature).gather(-1, ids)
    assert torch.equal(at_ids, values), f"{where}: top-k ids are not the oracle's top-k"
    if case.dtype == "fp32" and case.special is None:  # randn in fp32: no ties
        assert torch.equal(ids, oracle_ids), f"{where}: top-k ids differ from the oracle's"


def _extras_grad_bound(case, full, temperature, upstreams, ref_grad, delta, dtype) -> torch.Tensor:
    """Elementwise bound on our logits gradient's error.

    In ``z`` the gradient is ``Σ_k g_k (onehot_k − p) + g_lse p − g_H p (z − E[z])``.
    ``p = exp(z − lse)`` carries ``lse``'s error ``delta`` as a relative error, and ``z − E[z]``
    carries ``E[z] = lse − H``'s error ``delta``; so the error is at most
    ``delta · p · (Σ|g_k| + |g_lse| + |g_H| (3 + |z − E[z]|))`` (3: the two errors and the
    rounding of ``1 + z − E[z]``), plus one fp32 subnormal step of ``p`` times the same
    weight where the exponential underflows gradually: it is accurate to 1 ulp (Sleef's
    u10), not correctly rounded (``|z − E[z]|`` amplifies that by up to ``|z|``).
    Then ``dz/dlogits = 1 / temperature``, and four roundings relative to the result: the
    one-hot sum, adding it, dividing by the temperature (fp32) and into the gradient's dtype
    (plus half a subnormal step of the dtype where that flushes).
    """
    with torch.no_grad():
        log_softmax = oracle_log_softmax(full, temperature)
        probs = log_softmax.exp()
        z = log_softmax + oracle_logsumexp(full, temperature).unsqueeze(-1)
        mean = (probs * torch.where(probs > 0, z, 0.0)).sum(-1, keepdim=True)
        row_weight = torch.zeros(probs.shape[:-1], dtype=torch.float64)
        entropy_weight = torch.zeros_like(row_weight)
        for g, is_entropy in zip(upstreams, _entropy_outputs(case)):
            if is_entropy:
                entropy_weight += g.abs()
            else:
                row_weight += g.abs() if g.shape == row_weight.shape else g.abs().sum(-1)
        centred = torch.where(probs > 0, z - mean, 0.0).abs()
        weight = row_weight.unsqueeze(-1) + entropy_weight.unsqueeze(-1) * (3 + centred)
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.double().unsqueeze(-1)
        info = torch.finfo(dtype)
        rounding = (info.eps + 2 * FP32_EPS) * ref_grad.abs() + info.smallest_normal * info.eps / 2
        underflow = FP32_TINY
        return (delta * probs + underflow) * weight / temperature + rounding


def _entropy_outputs(case: ExtrasCase) -> tuple[bool, ...]:
    """Which outputs are entropies."""
    if case.api == "token_logprobs":
        return (False, True) if case.entropy else (False,)
    return (case.api == "vocab_parallel_entropy",)


def check_extras_case(case: ExtrasCase, group, run_ours=extras_ours) -> None:
    """Forward and backward of ``case`` on this rank's shard against the float64 oracle;
    ``run_ours`` makes our call (:func:`extras_ours`, or it on another device or compiled)."""
    rank, world = rank_and_size(group)
    where = f"{case} rank {rank}/{world}"
    start, end = vocab_bounds(case.vocab, world, rank)
    logits, target, temperature = _extras_inputs(case, world)
    shard = logits[..., start:end]
    gen = torch.Generator().manual_seed(case.seed + 1)
    out_shape = (*logits.shape[:-1], case.k) if case.k else logits.shape[:-1]
    upstreams = [
        torch.randn(out_shape if not is_entropy else logits.shape[:-1], generator=gen, dtype=torch.float64)
        for is_entropy in _entropy_outputs(case)
    ]
    ours, grad, ids = _extras_value_and_grad(
        lambda x: run_ours(case, x, target, start, group, temperature), shard, upstreams
    )
    full = logits.double()
    if ids is not None:
        _check_topk_ids(case, ids, full, temperature, where)
    upstreams = [u.float().double() for u in upstreams]  # as the autograd engine saw them
    refs, ref_grad, _ = _extras_value_and_grad(
        lambda x: (_extras_oracle(case, x, target, temperature, ids), None), full, upstreams
    )

    # delta: absolute error of an fp32 logsumexp-type value of z (as in check_numerics_case):
    # ~80 ulps of max(1, |z|max). The entropy is lse − E[z] with E[z] = lse − Σ_r w_r(H_r −
    # log w_r) summed from non-negative terms, so it carries the same delta: its rounding
    # scales with |z| (two fp32 roundings of lse-sized values), not with |z|².
    z = full / (temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature)
    delta = 1e-5 * max(1.0, torch.where(z.isfinite(), z.abs(), 0.0).max().item())
    for out, ref, is_entropy in zip(ours, refs, _entropy_outputs(case)):
        assert out.dtype == torch.float32 and out.shape == ref.shape, (where, out.shape, ref.shape)
        assert_within(out, ref, delta + FP32_EPS * ref.abs(), f"{where} output")
        # lse − fl(lse − H) >= 0 exactly for H >= 0: rounding never makes an entropy negative.
        assert not is_entropy or ((out >= 0) | out.isnan()).all(), f"{where}: negative entropy"
    if case.ignore:
        ignored_rows = _extras_ignored_rows(case, target)
        assert (ours[0].masked_select(target == IGNORE) == 0).all(), f"{where}: log-prob not 0"
        if case.entropy:
            assert (ours[1].masked_select(ignored_rows) == 0).all(), f"{where}: entropy not 0"
        assert (grad.masked_select(ignored_rows.unsqueeze(-1)) == 0).all(), f"{where}: gradient"
    if case.ignore:  # no gradient there, checked above, even where the oracle's is NaN
        ref_grad = torch.where(_extras_ignored_rows(case, target).unsqueeze(-1), 0.0, ref_grad)
    bound = _extras_grad_bound(case, full, temperature, upstreams, ref_grad, delta, grad.dtype)
    mine = slice(start, end)
    assert_within(grad, ref_grad[..., mine], bound[..., mine], f"{where} gradient")


# ---------------------------------------------------------------------------------------
# test_filtering's cases: log-probs under top-k/top-p filtering, on even vocabulary slices


# Top-p decisions closer than this to the boundary are rounding's to make.
FILTER_MARGIN = 1e-4


@dataclasses.dataclass(frozen=True)
class FilterCase:
    """Logits ``[*lead, seq, width · TP]`` of ``dtype``, ``N(0, scale²)``, seeded."""

    top_k: int | None = 20
    top_p: float = 1.0
    lead: tuple[int, ...] = (2,)
    seq: int = 13
    width: int = 101  # V_local
    dtype: str = "fp32"
    scale: float = 3.0
    temperature: str | None = None  # 0.7 ("float"), per row [*lead, 1], per position
    chunk: int | None = None
    ids: int = 0  # K > 0: [..., S, K] targets
    ignore: bool = False
    special: str | None = None  # "inf_shard" | "nan_row" | "ties"
    api: str = "token_logprobs"  # or "DistributedLogprobWithSampling" (its Chunked… with chunk)
    seed: int = 0

    def oracle_top_k(self) -> int | None:
        return None if self.top_k == -1 else self.top_k  # NeMo-RL's -1: no top-k


def _filter_inputs(case: FilterCase, world: int):
    gen = torch.Generator().manual_seed(case.seed)
    vocab = case.width * world
    shape = (*case.lead, case.seq, vocab)
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * case.scale
    if case.special == "ties":  # many equal values, around the boundaries too
        logits = logits.round()
    logits = logits.to(DTYPES[case.dtype])
    rows = logits.view(-1, vocab)
    # The last rank's whole slice (the last half without TP).
    inf_width = case.width if world > 1 else vocab // 2
    if case.special == "inf_shard":
        rows[::2, vocab - inf_width :] = float("-inf")
    if case.special == "nan_row":
        rows[rows.shape[0] // 2, vocab // 2] = float("nan")
    ids_shape = (*shape[:-1], max(case.ids, 1))
    top = min(3, vocab)
    likely = logits.float().nan_to_num(nan=0.0).topk(top, dim=-1).indices
    pick = likely.gather(-1, torch.randint(0, top, ids_shape, generator=gen))
    target = torch.where(
        torch.rand(ids_shape, generator=gen) < 0.5,
        pick,
        torch.randint(0, vocab, ids_shape, generator=gen),
    )
    if case.special == "inf_shard":
        target = target % (vocab - inf_width)
    if case.ignore:
        target = torch.where(torch.rand(ids_shape, generator=gen) < 0.3, IGNORE, target)
    target = target if case.ids else target[..., 0]
    if case.temperature == "float":
        temperature = 0.7
    elif case.temperature == "row":
        temperature = torch.linspace(0.5, 2.0, torch.Size(case.lead).numel()).view(*case.lead, 1)
    elif case.temperature == "position":
        temperature = 0.5 + 1.5 * torch.rand((*case.lead, case.seq), generator=gen)
    else:
        temperature = 1.0
    return logits, target, temperature


def filter_ours(case: FilterCase, shard, target, start: int, group, temperature):
    if case.api == "DistributedLogprobWithSampling":
        if case.chunk is None:
            return cl.DistributedLogprobWithSampling.apply(
                shard, target, group, case.top_k, case.top_p
            )
        return cl.ChunkedDistributedLogprobWithSampling.apply(
            shard, target, group, case.top_k, case.top_p, case.chunk
        )
    return cl.token_logprobs(
        shard,
        target,
        vocab_start=start,
        group=group,
        chunk_size=case.chunk,
        ignore_index=IGNORE if case.ignore else None,
        temperature=temperature,
        top_k=case.top_k,
        top_p=case.top_p,
    )


def _filter_oracle(case: FilterCase, full, target, temperature):
    """float64 log-probs of ``target`` (0 where ignored) and the rows that are settled: top-p
    margin above :data:`FILTER_MARGIN`, and no NaN."""
    log_softmax, margin = oracle_filtered_log_softmax(
        full, case.oracle_top_k(), case.top_p, temperature
    )
    ids = target if case.ids else target.unsqueeze(-1)
    ignored = ids == IGNORE
    out = torch.where(ignored, 0.0, log_softmax.gather(-1, torch.where(ignored, 0, ids)))
    settled = (margin > FILTER_MARGIN) & ~full.isnan().any(-1)
    return (out if case.ids else out.squeeze(-1)), settled


def check_filter_case(case: FilterCase, group, run_ours=filter_ours) -> None:
    """Forward and backward of ``case`` on this rank's slice against the float64 oracle;
    ``run_ours`` makes our call (:func:`filter_ours`, or it on another device or compiled)."""
    rank, world = rank_and_size(group)
    where = f"{case} rank {rank}/{world}"
    start = rank * case.width
    logits, target, temperature = _filter_inputs(case, world)
    full = logits.double()
    with torch.no_grad():
        _, settled = _filter_oracle(case, full, target, temperature)
    gen = torch.Generator().manual_seed(case.seed + 1)
    rows_mask = settled.unsqueeze(-1) if case.ids else settled
    upstream = torch.randn(target.shape, generator=gen, dtype=torch.float64)
    upstream = torch.where(rows_mask, upstream, 0.0).float().double()

    shard = logits[..., start : start + case.width].detach().requires_grad_()
    out = run_ours(case, shard, target, start, group, temperature)
    (grad,) = torch.autograd.grad(out, shard, upstream.float())
    leaf = full.clone().requires_grad_()
    ref, _ = _filter_oracle(case, leaf, target, temperature)
    # The oracle's -inf entries get no gradient (as ours): differentiate the finite ones.
    (ref_grad,) = torch.autograd.grad(torch.where(ref.isfinite(), ref, 0.0), leaf, upstream)

    assert out.dtype == torch.float32 and out.shape == target.shape, (where, out.shape)
    if case.special == "nan_row":
        nan_row = ~full.isnan().any(-1) | (target == IGNORE if not case.ids else False)
        assert out.isnan().logical_or(nan_row if not case.ids else nan_row.unsqueeze(-1)).all(), (
            where
        )
    z = full / (
        temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    )
    delta = 1e-5 * max(1.0, torch.where(z.isfinite(), z.abs(), 0.0).max().item())
    mask = rows_mask.expand_as(out)
    assert_within(out[mask], ref[mask], delta + FP32_EPS * ref[mask].abs(), f"{where} output")

    with torch.no_grad():
        log_softmax, _ = oracle_filtered_log_softmax(
            full, case.oracle_top_k(), case.top_p, temperature
        )
        probs = log_softmax.exp()
        weight = upstream.abs() if not case.ids else upstream.abs().sum(-1)
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.double()
        else:
            temperature = torch.tensor(temperature, dtype=torch.float64)
        info = torch.finfo(grad.dtype)
        bound = (delta * probs + FP32_TINY) * (weight / temperature).unsqueeze(-1)
        bound = (
            bound + (info.eps + 2 * FP32_EPS) * ref_grad.abs() + info.smallest_normal * info.eps / 2
        )
    mine = slice(start, start + case.width)
    finite_rows = ~full.isnan().any(-1)  # a NaN row's gradient is NaN
    assert_within(
        grad[finite_rows],
        ref_grad[..., mine][finite_rows],
        bound[..., mine][finite_rows],
        f"{where} gradient",
    )


# ---------------------------------------------------------------------------------------
# test_lm_head's cases: log-probs and entropy from hidden states and an LM-head weight


LM_HEAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class LMHeadCase:
    """Hidden states ``[*lead, seq, hidden]`` and an LM-head weight ``[vocab, hidden]`` of
    ``dtype``, seeded, and the options of the call."""

    lead: tuple[int, ...] = (2,)
    seq: int = 13
    hidden: int = 24
    vocab: int = 1003
    dtype: str = "fp32"
    chunk: int | None = 5
    ignore: bool = False  # ~30% of the targets are IGNORE
    temperature: float | str = 1.0  # or "rows" / "positions": see lm_head_temperature
    k: int | None = None  # K target ids per position ([..., S, K]), else one ([..., S])
    entropy: bool = True
    scale: float = 1.0  # of the weight, so of the logits
    seed: int = 0
    sequence_parallel: bool = False  # each rank passes its 1 / world of the sequence
    fp32_logits: bool = False  # logits_dtype=torch.float32


@contextlib.contextmanager
def lm_head_tiles(elements: int):
    """The LM-head ops' tiles hold about ``elements`` entries inside the block: a small
    number cuts each chunk into several blocks of whole ``TILE_WIDTH`` tiles."""
    default, lm_head_ops.TILE_ELEMENTS = lm_head_ops.TILE_ELEMENTS, elements
    try:
        yield
    finally:
        lm_head_ops.TILE_ELEMENTS = default


def lm_head_inputs(case: LMHeadCase):
    """hidden ``[*lead, S, H]``, full weight ``[V, H]`` (logits ~ N(0, 4)), targets and
    float64 upstream gradients for the log-probs and the entropy."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = LM_HEAD_DTYPES[case.dtype]
    shape = (*case.lead, case.seq)
    ids_shape = shape if case.k is None else (*shape, case.k)
    hidden = torch.randn(*shape, case.hidden, generator=gen).to(dtype)
    weight = torch.randn(case.vocab, case.hidden, generator=gen) * 2 * case.scale / case.hidden**0.5
    weight = weight.to(dtype)
    target = torch.randint(0, case.vocab, ids_shape, generator=gen)
    if case.ignore:
        target = torch.where(torch.rand(ids_shape, generator=gen) < 0.3, IGNORE, target)
    if case.k is not None:
        target[..., 0, -1] = target[..., 0, 0]  # an id twice at one position
        if case.ignore and case.seq > 1:
            target[..., 1, :] = IGNORE  # a position whose every id is ignored
    up_lp = torch.randn(ids_shape, generator=gen, dtype=torch.float64)
    return hidden, weight, target, up_lp, torch.randn(shape, generator=gen, dtype=torch.float64)


def lm_head_temperature(case: LMHeadCase) -> float | torch.Tensor:
    """The case's temperature as the entry points take it: a float, or fp32 temperatures in
    [0.5, 1.5] of shape ``[*lead, 1]`` ("rows") or ``[*lead, S]`` ("positions")."""
    if not isinstance(case.temperature, str):
        return case.temperature
    shape = (*case.lead, 1 if case.temperature == "rows" else case.seq)
    return torch.linspace(0.5, 1.5, math.prod(shape)).view(shape)


def run_lm_head(
    case: LMHeadCase, rank: int, world: int, group, api=lm_head_token_logprobs
) -> dict[str, torch.Tensor]:
    """This rank's log-probs, entropy and gradients of ``Σ lp·up + Σ entropy·up'``."""
    hidden, weight, target, up_lp, up_ent = lm_head_inputs(case)
    lo, hi = vocab_bounds(case.vocab, world, rank)
    hidden = hidden[..., sequence_rows(case, rank, world), :].clone().requires_grad_()
    weight = weight[lo:hi].clone().requires_grad_()
    out = api(hidden, weight, target, group=group, **lm_head_options(case, lo))
    return lm_head_backward(case, out, hidden, weight, up_lp, up_ent)


def sequence_rows(case: LMHeadCase, rank: int, world: int) -> slice:
    """The positions whose hidden states this rank passes: all, or with
    ``sequence_parallel`` its contiguous ``1 / world`` of them."""
    if not case.sequence_parallel:
        return slice(None)
    assert case.seq % world == 0, "sequence-parallel cases need S divisible by the ranks"
    part = case.seq // world
    return slice(rank * part, (rank + 1) * part)


def lm_head_options(case: LMHeadCase, vocab_start: int) -> dict:
    return dict(
        vocab_start=vocab_start,
        chunk_size=case.chunk,
        ignore_index=IGNORE if case.ignore else None,
        temperature=lm_head_temperature(case),
        return_entropy=case.entropy,
        **({"sequence_parallel": True} if case.sequence_parallel else {}),
        **({"logits_dtype": torch.float32} if case.fp32_logits else {}),
    )


def lm_head_backward(
    case: LMHeadCase, out, hidden, weight, up_lp, up_ent
) -> dict[str, torch.Tensor]:
    lp, ent = out if case.entropy else (out, torch.zeros(up_ent.shape))
    ((lp.double() * up_lp).sum() + (ent.double() * up_ent).sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad_h": hidden.grad, "grad_w": weight.grad}


def lm_head_oracle(case: LMHeadCase) -> dict[str, torch.Tensor]:
    return lm_head_oracle_of(case, *lm_head_inputs(case))


def lm_head_oracle_of(
    case: LMHeadCase, hidden, weight, target, up_lp, up_ent
) -> dict[str, torch.Tensor]:
    """float64 outputs and gradients, plus the magnitudes the tolerances scale with. The
    logits are the inputs' product rounded to their dtype, or with ``fp32_logits`` the
    float64 product of the (rounded) inputs."""
    product = hidden.double() @ weight.double().T if case.fp32_logits else hidden @ weight.T
    logits = product.double().requires_grad_()
    temperature = lm_head_temperature(case)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double().unsqueeze(-1)
    z = logits / temperature
    ignored = target == IGNORE if case.k is None else (target == IGNORE).all(-1)
    lp = oracle_logprobs(z, target, IGNORE)
    log_p = oracle_log_softmax(z)
    ent = torch.where(ignored, 0.0, -(log_p.exp() * log_p).sum(-1)) if case.entropy else 0 * up_ent
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    grad_z = logits.grad.reshape(-1, case.vocab)
    terms = _lm_head_gradient_terms(case, log_p.detach(), ent.detach(), target, up_lp, up_ent)
    terms = (terms / temperature).reshape(-1, case.vocab)
    h64, w64 = hidden.double().reshape(-1, case.hidden), weight.double()
    return {
        "lp": lp,
        "ent": ent,
        "grad_h": (grad_z @ w64).view(hidden.shape),
        "grad_w": grad_z.T @ h64,
        "bound_h": (grad_z.abs() @ w64.abs()).view(hidden.shape),
        "bound_w": grad_z.abs().T @ h64.abs(),
        "terms_h": (terms @ w64.abs()).view(hidden.shape),
        "terms_w": terms.T @ h64.abs(),
        "zmax": z.abs().max().item(),
    }


def _lm_head_gradient_terms(case: LMHeadCase, log_p, ent, target, up_lp, up_ent) -> torch.Tensor:
    """``[..., S, V]`` sum of the magnitudes of the terms of the gradient with respect to
    ``z``, before they cancel: ``Σ_k |g_k| · onehot(t_k) + Σ_k |g_k| · p + |g_H| · p ·
    (|log p| + H)``. Each is formed in fp32, so each carries fp32 error even where they sum
    to 0 (one id that takes all the mass: a one-entry vocabulary, or logits x1000)."""
    ids = target.unsqueeze(-1) if case.k is None else target
    weights = (up_lp.unsqueeze(-1) if case.k is None else up_lp).abs()
    weights = torch.where(ids == IGNORE, 0.0, weights)
    onehot = torch.zeros_like(log_p).scatter_add_(-1, torch.where(ids == IGNORE, 0, ids), weights)
    p = log_p.exp()
    terms = onehot + weights.sum(-1, keepdim=True) * p
    if case.entropy:
        terms = terms + up_ent.abs().unsqueeze(-1) * (-torch.special.xlogy(p, p) + p * ent.unsqueeze(-1))
    return terms


def check_lm_head(
    case: LMHeadCase, got: dict[str, torch.Tensor], want: dict, rank: int, world: int
) -> None:
    """Forward: fp32 math (error ∝ the logits' magnitude) plus one rounding of each logit in
    the inputs' dtype (a matmul may block differently per tile). Gradients: fp32 math,
    relative to the magnitudes of the terms that the gradient sums (``terms_*``), plus the
    rounding of the logits' gradient and of each chunk's matmul product in the inputs'
    dtype, each ≤ u·Σ|grad_z|·|operand| (``bound_*``)."""
    u = torch.finfo(LM_HEAD_DTYPES[case.dtype]).eps / 2
    fp32_math = 1e-5 * (1 + want["zmax"])
    # fp32 logits carry no rounding to the inputs' dtype.
    atol = fp32_math + (0 if case.fp32_logits else 2 * u * want["zmax"])
    for name in ("lp", "ent"):
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name].double(), want[name], rtol=0, atol=atol, msg=name)
    lo, hi = vocab_bounds(case.vocab, world, rank)
    rows = sequence_rows(case, rank, world)
    for name, want_grad, bound, terms in (
        ("grad_h", want["grad_h"][..., rows, :], want["bound_h"][..., rows, :], want["terms_h"][..., rows, :]),
        ("grad_w", want["grad_w"][lo:hi], want["bound_w"][lo:hi], want["terms_w"][lo:hi]),
    ):
        got_grad = got[name]
        assert got_grad.dtype == LM_HEAD_DTYPES[case.dtype], name
        err = (got_grad.double() - want_grad).abs()
        tol = 4 * u * bound + fp32_math * terms + 1e-6
        assert (err <= tol).all(), f"{name}: max error {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"


LM_HEAD_CASES = [
    LMHeadCase(),
    LMHeadCase(dtype="bf16"),
    LMHeadCase(ignore=True, temperature=0.7),
    LMHeadCase(dtype="bf16", ignore=True, temperature=1.3, chunk=None),
    LMHeadCase(ignore=True, temperature="positions"),
    LMHeadCase(dtype="bf16", temperature="rows", chunk=None),
    LMHeadCase(ignore=True, temperature="positions", k=3),
    LMHeadCase(lead=(1,), seq=7, chunk=3, entropy=False),
    LMHeadCase(lead=(2, 3), seq=6, vocab=517, hidden=8, chunk=4),
]


# ---------------------------------------------------------------------------------------
# opcheck cases of every custom op, by the op's qualified name
#
# OPCHECK_CASES maps each op of the ``compiled_logprob`` namespace to a function
# ``cases(dtype, group_name)`` that yields the op's ``(args, kwargs)`` in that dtype;
# ``group_name`` is a two-rank fake process group's, for the cases that take a group.
# test_compile_contract opchecks every entry in fp32 and bf16, and checks that the ops here
# are exactly the ones the package registers. Ops are named by their qualified names and
# called through ``torch.ops`` (:func:`custom_op`), whichever module defines them.

_OPCHECK_BATCH = 2
_OPCHECK_IGNORE = 3  # an id inside the vocabulary, so that ignoring it is what excludes it


def custom_op(qualified_name: str) -> torch._ops.OpOverload:
    """The default overload of an op, ``"namespace::name"``, through ``torch.ops``."""
    namespace, name = qualified_name.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def _op_inputs(seq_len: int = 5, vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits ``[B, S, V]`` and targets ``[B, S]``, every other one ignored."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(_OPCHECK_BATCH, seq_len, vocab, generator=gen)
    target = torch.randint(0, vocab, (_OPCHECK_BATCH, seq_len), generator=gen)
    target[:, ::2] = _OPCHECK_IGNORE
    return logits, target


def _stats_cases(dtype: torch.dtype, group_name: str):
    logits, target = _op_inputs()
    targets = target.unsqueeze(-1)
    two_targets = torch.cat([targets, targets.clamp(min=0).flip(1)], dim=-1)
    # The fake group duplicates rows: no rank owns a target, so every one is ignored.
    all_ignored = torch.full_like(targets, _OPCHECK_IGNORE)
    temperature = torch.linspace(0.5, 2.0, logits.shape[1]).expand(logits.shape[:-1])
    # Wide enough for the top-k's block maxima (not the fallback to torch.topk), with a tail.
    wide_logits, _ = _op_inputs(vocab=4 * 3 * TOPK_BLOCK + 5)
    options = dict(
        vocab_start=0,
        group_name=None,
        ignore_index=None,
        with_entropy=False,
        topk=0,
        chunk_size=None,
    )
    entropy = {**options, "with_entropy": True}
    chunked = {**options, "chunk_size": 2}
    ignore = _OPCHECK_IGNORE
    leaf = logits.to(dtype).requires_grad_()
    wide = wide_logits.to(dtype).requires_grad_()
    return [
        ((leaf, targets, None), options),
        ((leaf, None, None), options),
        ((leaf, targets, None), {**options, "ignore_index": ignore}),
        ((leaf, targets, None), chunked),
        ((leaf, two_targets, temperature), {**chunked, "with_entropy": True}),
        ((leaf, two_targets, temperature), {**entropy, "ignore_index": ignore}),
        ((leaf, None, temperature), entropy),
        ((leaf, all_ignored, None), {**entropy, "group_name": group_name, "ignore_index": ignore}),
        ((leaf, None, None), {**options, "group_name": group_name}),
        ((wide, None, temperature), {**chunked, "topk": 3}),
        ((leaf, None, None), {**options, "topk": 7}),
        ((leaf, None, None), {**entropy, "topk": 2, "group_name": group_name}),
    ]


def _stats_backward_cases(dtype: torch.dtype, group_name: str):
    logits, target = _op_inputs()
    targets = target.unsqueeze(-1)
    temperature = torch.linspace(0.5, 2.0, logits.shape[1]).expand(logits.shape[:-1])
    shift = logits.amax(-1)
    log_total = torch.logsumexp(logits, -1) - shift
    threshold = logits.topk(3, dim=-1).values[..., -1]
    gen = torch.Generator().manual_seed(1)
    grad_log_total, grad_target_logit, grad_entropy, entropy = torch.randn(
        4, *shift.shape, generator=gen
    )
    grad_target_logit = grad_target_logit.unsqueeze(-1)
    z = logits.to(dtype)

    def args(target, grad_entropy, temp, threshold=None):
        k = 0 if target is None else 1
        grads = (grad_log_total, grad_target_logit[..., :k], grad_entropy)
        return (*grads, z, target, temp, shift, log_total, entropy, threshold)

    options = dict(vocab_start=0, ignore_index=None, chunk_size=None)
    ignore = _OPCHECK_IGNORE
    return [
        (args(targets, None, None), options),
        (args(targets, None, None), {**options, "vocab_start": 2, "ignore_index": ignore}),
        (args(None, None, None), {**options, "chunk_size": 2}),
        (args(targets, grad_entropy, temperature), {**options, "ignore_index": ignore}),
        (args(targets, None, temperature, threshold), {**options, "ignore_index": ignore}),
    ]


def _filtered_cases(dtype: torch.dtype, group_name: str):
    logits, target = _op_inputs()
    targets = target.unsqueeze(-1)
    two_targets = torch.cat([targets, targets.flip(1)], dim=-1)
    temperature = torch.linspace(0.5, 2.0, logits.shape[1]).expand(logits.shape[:-1])
    options = {
        "vocab_start": 0,
        "group_name": None,
        "ignore_index": None,
        "top_k": 3,
        "top_p": 1.0,
        "chunk_size": None,
    }
    top_p = {**options, "top_k": 7, "top_p": 0.8}
    leaf = logits.to(dtype).requires_grad_()
    return [
        ((leaf, targets, None), options),
        ((leaf, two_targets, temperature), {**top_p, "ignore_index": _OPCHECK_IGNORE}),
        ((leaf, targets, temperature), {**top_p, "top_k": 2, "chunk_size": 2}),
        ((leaf, targets, None), {**top_p, "group_name": group_name}),
    ]


def _cross_entropy_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    logits, teacher = 3 * torch.randn(2, 2, 5, 7, generator=gen)
    temperature = torch.linspace(0.5, 2.0, 5).expand(2, 5)
    return logits.to(dtype), teacher.to(dtype), temperature, gen


def _cross_entropy_cases(dtype: torch.dtype, group_name: str):
    logits, teacher, temperature, _ = _cross_entropy_inputs(dtype)
    stats = {"group_name": None, "chunk_size": None}
    x, y = logits.requires_grad_(), teacher.requires_grad_()
    return [
        ((x, y, None), stats),
        ((x, y, temperature), {**stats, "chunk_size": 2}),
        ((x, y.detach(), None), {**stats, "group_name": group_name}),
    ]


def _cross_entropy_backward_cases(dtype: torch.dtype, group_name: str):
    x, y, temperature, gen = _cross_entropy_inputs(dtype)
    stats = {"group_name": None, "chunk_size": None}
    outputs = custom_op("compiled_logprob::cross_entropy_stats")(x, y, temperature, **stats)
    grad = torch.randn(2, 5, generator=gen)
    args = (grad, x, y, temperature, *outputs)
    return [
        (args, {"wrt_target": wrt_target, "chunk_size": 2 if wrt_target else None})
        for wrt_target in (False, True)
    ]


# (case, top-k, with the fake group): the forward op of the case's targets (or of the top-k
# with top-k > 0), and the backward op after it. With the group, the fake all-gather's
# values are meaningless: the case ignores every target, or takes the top-k, so that the
# ownership assertion does not depend on them.
_LM_HEAD_OPCHECK = [
    (LMHeadCase(), 0, False),
    (LMHeadCase(dtype="bf16", entropy=False, chunk=None), 0, False),
    (LMHeadCase(k=3), 0, False),
    (LMHeadCase(), 5, False),
    (LMHeadCase(dtype="bf16", entropy=False, chunk=None), 5, False),
    (LMHeadCase(seq=6, chunk=4, ignore=True), 0, True),
    (LMHeadCase(seq=6, chunk=4), 3, True),
    (LMHeadCase(dtype="bf16", fp32_logits=True), 0, False),
]


def _lm_head_op_args(case: LMHeadCase, requires_grad: bool):
    hidden, weight, target, _, _ = lm_head_inputs(case)
    if case.ignore:
        target = torch.full_like(target, IGNORE)
    if case.k is None:
        target = target.unsqueeze(-1)  # the op takes [B, S, K] ids
    hidden, weight = hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad)
    temperature = lm_head_temperature(dataclasses.replace(case, temperature="positions"))
    options = dict(
        vocab_start=0,
        ignore_index=IGNORE,
        chunk_size=case.chunk,
        sequence_parallel=False,
        logits_dtype=torch.float32 if case.fp32_logits else hidden.dtype,
    )
    return hidden, weight, target, temperature, options


def _lm_head_opcheck_inputs(dtype: torch.dtype, group_name: str):
    """``(case, topk, (hidden, weight, target, temperature), options)`` of the forward op,
    for each case of :data:`_LM_HEAD_OPCHECK` in ``dtype``."""
    for case, topk, grouped in _LM_HEAD_OPCHECK:
        if LM_HEAD_DTYPES[case.dtype] != dtype:
            continue
        hidden, weight, target, temperature, options = _lm_head_op_args(case, requires_grad=True)
        options["group_name"] = group_name if grouped else None
        yield case, topk, (hidden, weight, None if topk else target, temperature), options


def _lm_head_cases(dtype: torch.dtype, group_name: str):
    for case, topk, inputs, options in _lm_head_opcheck_inputs(dtype, group_name):
        yield inputs, dict(options, with_entropy=case.entropy, topk=topk)


def _lm_head_backward_cases(dtype: torch.dtype, group_name: str):
    """The backward op after the forward, for each set of gradients autograd may ask for."""
    for case, topk, inputs, options in _lm_head_opcheck_inputs(dtype, group_name):
        hidden, weight, target, temperature = inputs
        hidden, weight = hidden.detach(), weight.detach()
        forward_options = dict(options, with_entropy=case.entropy, topk=topk)
        shift, log_total, _, entropy, topk_ids, _ = custom_op("compiled_logprob::lm_head_stats")(
            hidden, weight, target, temperature, **forward_options
        )
        if topk:
            target = topk_ids
        grads = torch.randn(2, *shift.shape)
        grad_entropy = grads[1] if case.entropy else None
        grad_target_logit = torch.randn(target.shape)
        args = (grads[0], grad_target_logit, grad_entropy, hidden, weight, target, temperature)
        args += (shift, log_total, entropy, None)
        for needs in ((True, True), (True, False), (False, True)):
            flags = dict(zip(("needs_grad_hidden", "needs_grad_weight"), needs))
            yield args, {**options, **flags}


def _lm_head_filtered_cases(dtype: torch.dtype, group_name: str):
    """The filtered op, single process (its all-to-all needs a real group's ranks)."""
    for case, topk, inputs, options in _lm_head_opcheck_inputs(dtype, group_name):
        if topk or options["group_name"] is not None:
            continue
        yield inputs, dict(options, top_k=7, top_p=0.8)


def _lm_head_filtered_backward_cases(dtype: torch.dtype, group_name: str):
    for (hidden, weight, target, temperature), options in _lm_head_filtered_cases(dtype, group_name):
        hidden, weight = hidden.detach(), weight.detach()
        shift, log_norm, _, threshold, _ = custom_op("compiled_logprob::lm_head_filtered_stats")(
            hidden, weight, target, temperature, **options
        )
        backward_options = {k: v for k, v in options.items() if k not in ("top_k", "top_p")}
        args = (torch.randn(shift.shape), torch.randn(target.shape), None, hidden, weight, target)
        args += (temperature, shift, log_norm, None, threshold)
        yield args, {**backward_options, "needs_grad_hidden": True, "needs_grad_weight": True}


def _lm_head_cross_entropy_inputs(dtype: torch.dtype, group_name: str):
    gen = torch.Generator().manual_seed(0)
    for fp32_logits, grouped, chunk in ((False, False, 2), (True, False, None), (False, True, 3)):
        hidden = torch.randn(2, 5, 8, generator=gen).to(dtype).requires_grad_()
        weight = torch.randn(37, 8, generator=gen).to(dtype).requires_grad_()
        teacher_hidden = torch.randn(2, 5, 12, generator=gen).to(dtype).requires_grad_()
        teacher_weight = torch.randn(37, 12, generator=gen).to(dtype)
        temperature = torch.rand(2, 5, generator=gen) + 0.5
        logits_dtype = torch.float32 if fp32_logits else dtype
        options = dict(
            group_name=group_name if grouped else None,
            chunk_size=chunk,
            sequence_parallel=False,
            logits_dtype=logits_dtype,
            teacher_logits_dtype=logits_dtype,
        )
        yield (hidden, weight, teacher_hidden, teacher_weight, temperature), options


def _lm_head_cross_entropy_cases(dtype: torch.dtype, group_name: str):
    yield from _lm_head_cross_entropy_inputs(dtype, group_name)


def _lm_head_cross_entropy_backward_cases(dtype: torch.dtype, group_name: str):
    for inputs, options in _lm_head_cross_entropy_inputs(dtype, group_name):
        inputs = tuple(t.detach() for t in inputs)
        local = {**options, "group_name": None}
        outputs = custom_op("compiled_logprob::lm_head_cross_entropy_stats")(*inputs, **local)
        grad = torch.randn(outputs[0].shape)
        for needs in ([True, True, False, False], [False, True, True, True], [True, False, True, False]):
            yield (grad, *inputs, *outputs), {**options, "needs": needs}


def _pointwise_cases(dtype: torch.dtype, group_name: str):
    gen = torch.Generator().manual_seed(0)
    rows = torch.rand(2, 5, 3, generator=gen).to(dtype) + 0.5
    yield (rows, "exp"), {}
    yield (rows.double(), "log"), {}


OPCHECK_CASES = {
    "compiled_logprob::pointwise": _pointwise_cases,
    "compiled_logprob::vocab_parallel_stats": _stats_cases,
    "compiled_logprob::vocab_parallel_stats_backward": _stats_backward_cases,
    # The in-place twin writes into its logits: each case its own copy.
    "compiled_logprob::vocab_parallel_stats_backward_": lambda dtype, group_name: [
        ((*args[:3], args[3].clone(), *args[4:]), options)
        for args, options in _stats_backward_cases(dtype, group_name)
    ],
    "compiled_logprob::filtered_stats": _filtered_cases,
    "compiled_logprob::cross_entropy_stats": _cross_entropy_cases,
    "compiled_logprob::cross_entropy_backward": _cross_entropy_backward_cases,
    "compiled_logprob::lm_head_stats": _lm_head_cases,
    "compiled_logprob::lm_head_stats_backward": lambda dtype, group_name: itertools.chain(
        _lm_head_backward_cases(dtype, group_name), _lm_head_filtered_backward_cases(dtype, group_name)
    ),
    "compiled_logprob::lm_head_filtered_stats": _lm_head_filtered_cases,
    "compiled_logprob::lm_head_cross_entropy_stats": _lm_head_cross_entropy_cases,
    "compiled_logprob::lm_head_cross_entropy_backward": _lm_head_cross_entropy_backward_cases,
}


def run_example(name: str, timeout: float) -> str:
    """Runs ``examples/{name}`` as a reader would (a fresh interpreter, the checkout on the
    path) and returns its output; a failure shows its output."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(root / "examples" / name)],
        env=env, capture_output=True, text=True, timeout=default_timeout(timeout),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def check_compiled_without_recompiles(fn, inputs_at, seqs=(5, 9, 13)) -> None:
    """``fn(logits, *rest)`` compiled (fullgraph) equals eager, forward and the logits'
    gradient, for the ``(logits, rest)`` of ``inputs_at(seq)`` at each length, in at most
    two graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for seq in seqs:
        logits, rest = inputs_at(seq)
        eager, graph = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        want, got = fn(eager, *rest), compiled(graph, *rest)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(graph.grad, eager.grad)
    assert counters["stats"]["unique_graphs"] - before <= 2
