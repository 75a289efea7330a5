"""Per-shard math of the vocab-parallel log-softmax: plain, loop-free torch code.

Every function here works on one block of rows and is written so that Inductor fuses it
into a single pass over the logits. The eager kernels in ``_ops`` call these on
cache-sized row blocks; the Inductor decompositions call them once on the whole tensor.

Shape legend: ``B`` batch, ``S`` sequence, ``V_local`` this rank's vocabulary slice,
``R`` ranks of the vocab-parallel group, ``K`` target ids per position, ``F`` statistics
per row. The scaled logits are ``z = logits / temperature`` (``temperature`` ``[B, S]`` or
``None`` for 1); everything below is over ``z``, in fp32, but ``z`` itself is never
formed: the temperature folds into the one per-row multiply that every pass does anyway.

Statistics of one shard, ``[B, S, F]``, are raw sums, so that one loop over the logits
produces them all and the logs and divisions wait until after the exchange:
``[max x, Σ exp(z − max z), Σ exp(z − max z)·(z − max z) (with entropy), x_target × K,
owned × K]``, or with a top-k, ``[..., candidate x × k, candidate global id × k]`` in place
of the target's part. Maxima and logits travel unscaled (``x``, not ``z``): after the
exchange, ``(x − shift) / temperature`` with ``shift`` the row's max is exact up to one
rounding, so that log-probs keep their precision however large the logits are.
The statistics are the last dimension because Inductor's CPU code
generator keeps a per-row epilogue in the reductions' loop only when it walks the rows
one at a time; ``[F, B, S]`` made it vectorise the epilogue across rows and split the
kernel into one pass over the logits per reduction.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from compiled_logprob._torch_version import all_gather_single

OWNERSHIP_ERROR = (
    "compiled_logprob: a target id is not owned by exactly one vocabulary shard (negative, "
    ">= the vocabulary size, or [vocab_start, vocab_end) ranges that overlap or leave a gap). "
    "Mask it (ignore_index=... gives log-prob 0) or fix the shard bounds."
)

# CUDA's kernel-side assert refuses a longer message (RuntimeError: "Message length must be
# smaller than 255"), so a check that reads well on CPU would break every call on a GPU.
DEVICE_MESSAGE_LIMIT = 254


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async`` (no host sync), with the message's length checked on every
    device, not only where CUDA would refuse it."""
    assert len(message) <= DEVICE_MESSAGE_LIMIT, f"over {DEVICE_MESSAGE_LIMIT} characters: {message}"
    torch._assert_async(condition, message)


_INF = float("inf")
_PROMOTE_TO_FP32 = (torch.float16, torch.bfloat16, torch.float32)
# Entries per block of local_topk's block maxima: measured fastest of 8-64 on CPU, eager and
# compiled (fewer candidates to select from, k · 16, against more maxima, V / 16).
TOPK_BLOCK = 16
_LN_2 = math.log(2.0)
# A floor for exponents: e^c and 2^c are 0 in fp32 below c = -150 already.
_EXPONENT_FLOOR = -1024.0
# Slices of a row that the traced CPU statistics combine elementwise before reducing it:
# Inductor's CPU reduction loop keeps one vector accumulator, so each max or add waits for
# the previous one; eight slices in a balanced tree give the loop independent work (the
# plain pass measured 0.83-0.88x its single-accumulator time on 2-core EPYC and Xeon).
ROW_SLICES = 8
# The entropy's two sums take half as many: a tree of eight slices of both terms exceeds
# Inductor's CPU op-count limit for inlining, and it stores the tree as a [B, S, V/8] buffer
# (in bf16, and in fp32 when traced for training: 1.5-1.8x the plain pass's time). Four
# measured 1.16x (bf16) and 1.16-1.18x (fp32) the plain pass's forward, against 1.21x and
# 1.14-1.16x with plain sums; one sum sliced and one plain splits the loop (1.6-1.8x).
ENTROPY_SLICES = 4


def _promoted(logits: torch.Tensor) -> torch.Tensor:
    """The logits as they are when every use promotes them to fp32 exactly (16- and
    32-bit floats meet an fp32 tensor in each op), else an fp32 copy: no fp32 copy of a
    block is made for the usual dtypes."""
    return logits if logits.dtype in _PROMOTE_TO_FP32 else logits.float()


def _unit(eager: bool) -> float:
    """Nats per unit of the exponents ``c`` that a pass over the logits exponentiates.

    Traced: base 2 (``exp2``), which Inductor's CPU code runs as fast as ``exp``, with the
    scaling fused. Eager: nats, since every op is a pass over the block: without a
    temperature ``exp(x − shift)`` needs no scaling pass, and ATen's ``exp`` is faster
    than its ``exp2`` besides (an fp32 8 × 32000 block, max to sum: 54 µs against 80 µs in
    base 2, on the 2-core Xeon)."""
    return 1.0 if eager else _LN_2


def _exponent_scale(temperature: torch.Tensor | None, unit: float) -> float | torch.Tensor:
    """``1 / (unit · temperature)``, ``[B, S]`` (or a float without a temperature): one
    multiply takes ``x − shift`` to exponents ``c`` of ``z = x / temperature``, in units of
    ``unit`` nats. A positive temperature is monotone, so ``max(z) = max(x) / temperature``
    exactly and the logits are never divided element by element."""
    return 1.0 / unit if temperature is None else (1.0 / unit) / temperature


def _exp_op(eager: bool) -> str:
    """The exponential of :func:`_unit`'s exponents: ``exp`` eagerly, ``exp2`` traced."""
    return "exp" if eager else "exp2"


def _scaled(eager: bool, tensor: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``tensor · scale`` (in place eagerly), skipping the pass when ``scale`` is 1."""
    if isinstance(scale, float) and scale == 1.0:
        return tensor
    return _inplace(eager, tensor, "mul", scale)


def _finite_or_zero(row_max: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp's convention: shifting by 0 where the max is infinite makes an
    # all -inf row sum to 0 (lse -inf) and keeps a +inf logit +inf, instead of NaN.
    return torch.where(row_max.abs() == _INF, 0.0, row_max)


def _minus(z: torch.Tensor, rows: torch.Tensor, workspace: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``z − rows`` (``rows`` ``[B, S, 1]``), fresh or written into ``workspace``
    (in place when ``z`` already lives there).

    The workspace is one block buffer that an eager call reuses for all its blocks (no
    allocation, and no page faults, per block).
    """
    if workspace is None:
        return z - rows
    if z is workspace:
        return z.sub_(rows)
    if z.dtype == workspace.dtype:
        return torch.sub(z, rows, out=workspace)
    return _into(workspace, z).sub_(rows)


def _into(workspace: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``z`` copied into the fp32 ``workspace``: for a 16-bit block a plain conversion is
    several times faster than ATen's mixed-dtype arithmetic with an ``out=`` of fp32."""
    return workspace.copy_(z)


def _into_or_fresh(workspace: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor:
    """``z`` in fp32: copied into ``workspace`` when given, else a fresh copy."""
    return z.float() if workspace is None else _into(workspace, z)


def _mixture_entropy(
    log_weights: torch.Tensor, entropies: torch.Tensor, dim: int
) -> torch.Tensor:
    """Entropy ``Σ_i w_i · (H_i − log w_i)`` of a mixture of disjoint distributions with
    weights ``w = exp(log_weights)`` (summing to 1 along ``dim``) and entropies ``H``.

    Every term is non-negative, so nothing cancels: the error stays a few ulps of the
    logits, where ``lse − E[z]`` would lose ulps of ``|z|`` times ``|z|``. A component of
    weight 0 contributes 0, even when its ``log w`` is ``-inf`` or NaN (a whole -inf shard);
    a NaN weight (a NaN logit) makes the entropy NaN.
    """
    weights = torch.exp(log_weights)
    return torch.where(weights == 0, 0.0, weights * (entropies - log_weights)).sum(dim)


def _sliced(terms: torch.Tensor, combine, reduce, slices: int = ROW_SLICES) -> torch.Tensor:
    """``reduce(terms)``, a keepdim reduction over the last dimension ``[..., V]``, as
    Inductor's CPU code runs it fastest: ``combine`` (``torch.maximum``, ``torch.add``)
    merges ``slices`` contiguous slices of ``V // slices`` entries elementwise, in a
    balanced tree, then ``reduce`` takes that and the ``V % slices`` entries left over.
    Other devices reduce in one go (Triton's reductions have no such chain)."""
    width = terms.shape[-1] // slices
    if width == 0 or not terms.is_cpu:
        return reduce(terms)
    parts = list(terms[..., : width * slices].unflatten(-1, (slices, width)).unbind(-2))
    while len(parts) > 1:
        parts = [combine(*parts[i : i + 2]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    reduced, rest = reduce(parts[0]), terms[..., width * slices :]
    return reduced if rest.shape[-1] == 0 else combine(reduced, reduce(rest))


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return _sliced(x, torch.maximum, lambda t: t.amax(-1, keepdim=True))


def _row_sum(terms: torch.Tensor, slices: int = ROW_SLICES) -> torch.Tensor:
    return _sliced(terms, torch.add, lambda t: t.sum(-1, keepdim=True), slices)


def local_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    vocab_start: int,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    row_max: torch.Tensor | None = None,
    eager: bool = False,
    workspace: torch.Tensor | None = None,
    spare: torch.Tensor | None = None,
) -> torch.Tensor:
    """This shard's raw statistics, fp32 ``[B, S, F]`` (layout in the module docstring; the
    top-k part is :func:`topk_stats`'s).

    ``x_target`` is the logit at the target where this shard owns it (0 elsewhere), and
    ``owned`` is 1.0 there. ``logits`` ``[B, S, V_local]``, ``target`` ``[B, S, K]`` global
    vocabulary ids. ``row_max`` ``[B, S, 1]``: the logits' max per row when the caller has it
    already (:func:`topk_stats` does). ``eager`` (op-by-op calls) updates fresh temporaries
    in place, in the fp32 blocks ``workspace`` and, with entropy, ``spare`` (the logits'
    shape) when given; traced for Inductor the code must stay functional, and on CUDA it
    takes the form of :func:`_online_softmax_stats`.
    """
    if not eager and row_max is None and _uses_online_softmax(logits):
        stats = _online_softmax_stats(logits, temperature, with_entropy)
    else:
        stats = _shifted_stats(
            logits,
            temperature=temperature,
            with_entropy=with_entropy,
            row_max=row_max,
            eager=eager,
            workspace=workspace,
            spare=spare,
        )
    if target is not None:
        stats.append(target_stats(logits, target, vocab_start))
    return torch.cat(stats, dim=-1)


def _shifted_stats(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    with_entropy: bool,
    row_max: torch.Tensor | None,
    eager: bool,
    workspace: torch.Tensor | None,
    spare: torch.Tensor | None,
) -> list[torch.Tensor]:
    """:func:`local_stats`' ``[x_max, Σ exp(u)(, Σ u · exp(u))]``, ``u = (x − x_max) / T``,
    as ``[B, S, 1]`` parts, shifted by a finite max and exponentiated in :func:`_unit`'s
    units: the form of the eager kernels and of Inductor's CPU code."""
    x = _promoted(logits)
    if eager and x.dtype != torch.float32:
        # ATen reduces a 16-bit inner dimension several times slower than an fp32 one:
        # convert the block first (into the workspace when given) and work on it in place.
        x = workspace = _into_or_fresh(workspace, logits)
    if row_max is None:
        row_max = x.amax(-1, keepdim=True) if eager else _row_max(x)
    x_max = row_max.float()
    unit = _unit(eager)
    (scale,) = _per_row(eager, _exponent_scale(temperature, unit))
    centred = _scaled(eager, _minus(x, _finite_or_zero(x_max), workspace), scale)
    if not with_entropy:
        exps = _inplace(eager, centred, _exp_op(eager))
        return [x_max, exps.sum(-1, keepdim=True) if eager else _row_sum(exps)]
    exps = getattr(torch, _exp_op(eager))(centred, out=spare)
    # e^c · c is NaN where c = -inf (vocabulary padding), for a term that is 0.
    if eager:
        # nansum drops it at no cost (a NaN logit still gives NaN: it is the max, and
        # every sum has it).
        weighted = centred.mul_(exps).nansum(-1, keepdim=True)
    else:
        # Inductor's nansum splits the loop; a floor on c does it (2^c is 0 already).
        weighted = _row_sum(centred.clamp(min=_EXPONENT_FLOOR) * exps, ENTROPY_SLICES)
    total = exps.sum(-1, keepdim=True) if eager else _row_sum(exps, ENTROPY_SLICES)
    return [x_max, total, weighted * unit]


def _uses_online_softmax(logits: torch.Tensor) -> bool:
    """Whether Inductor's online softmax (Triton-only) can take the statistics' pass."""
    return logits.device.type == "cuda"


def _online_softmax_stats(
    logits: torch.Tensor, temperature: torch.Tensor | None, with_entropy: bool
) -> list[torch.Tensor]:
    """:func:`local_stats`' ``[x_max, Σ exp(u)(, Σ u · exp(u))]`` parts written as
    ``amax``, ``z − max``, ``exp``, ``sum`` of ``z = x / T``: the form that Inductor's
    online softmax matches on CUDA, where Triton then reads each row once for both the max
    and the sum (the base-2, infinity-guarded CPU form reads it twice: 1.44–1.53× the one
    read of the floor on an H200). The guards come after the sums: an all ``-inf`` row sums
    to 0 and a ``+inf`` max to ``inf``, as :func:`_finite_or_zero` makes the CPU form do.
    """
    x = logits.float()
    z = x if temperature is None else x * (1.0 / temperature.unsqueeze(-1))
    z_max = z.amax(-1, keepdim=True)
    centred = z - z_max
    exps = centred.exp()
    total = exps.sum(-1, keepdim=True)
    empty = z_max == -_INF
    total = torch.where(empty, 0.0, torch.where(z_max == _INF, _INF, total))
    # A positive temperature is monotone: the max of z is the max of x, scaled.
    stats = [z_max if temperature is None else x.amax(-1, keepdim=True), total]
    if with_entropy:
        # exp(u) · u is NaN where u = -inf (vocabulary padding), for a term that is 0: a
        # floor far below where exp(u) is 0 already keeps it 0.
        weighted = (centred.clamp(min=_EXPONENT_FLOOR) * exps).sum(-1, keepdim=True)
        stats.append(torch.where(empty, 0.0, weighted))
    return stats


def topk_stats(
    logits: torch.Tensor, k: int, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k part of the statistics, fp32 ``[B, S, 2k]`` ``[candidate x × k, candidate
    global id × k]``: this shard's top ``k``, and the row max ``[B, S, 1]`` for
    :func:`local_stats`, which the block maxima give on the way. Traced for Inductor, their
    max loop is the statistics kernel's; eager kernels select once for all rows."""
    values, ids, row_max = local_topk(logits, k)
    # Ids travel as fp32 beside the values: exact below 2**24 vocabulary entries.
    return torch.cat([values.float(), (ids + vocab_start).float()], dim=-1), row_max


def target_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The ``[x_target × K, owned × K]`` part of :func:`local_stats`, fp32 ``[B, S, 2K]``: a
    gather of K entries per row, which eager kernels do once for all rows rather than block
    by block."""
    index, owned = _local_ids(target, vocab_start, logits.shape[-1])
    picked = logits.gather(-1, index).float()
    return torch.cat([torch.where(owned, picked, 0.0), owned.float()], dim=-1)


def _local_ids(
    target: torch.Tensor, vocab_start: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, owned)`` of global ids ``target``: their index in this shard of ``vocab``
    entries (0 where it does not own them, a safe index to gather or scatter at) and
    whether it owns them."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0), owned


def local_topk(
    logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits.topk(k)`` (values, local ids) of ``[..., V_local]``, via block maxima, and the
    row max ``[..., 1]`` that the maxima give on the way.

    The top k entries of a row lie in its k blocks with the largest maxima (any entry of
    another block is below k distinct block maxima), or in the tail that fills no block.
    So one max-reduction pass and a top-k over the k best blocks' ``k · TOPK_BLOCK``
    entries replace a selection over the whole vocabulary. Ties may pick other ids of equal
    value.
    """
    vocab = logits.shape[-1]
    blocks = vocab // TOPK_BLOCK
    if 4 * k * TOPK_BLOCK > vocab:
        values, ids = logits.topk(k, dim=-1)
        return values, ids, logits.amax(-1, keepdim=True)
    full = blocks * TOPK_BLOCK
    # Any partition into blocks works; block j holds entries j, j + blocks, ..., so that the
    # maxima reduce an outer dimension, elementwise across blocks: contiguous blocks cost a
    # horizontal reduction per block (measured 1.5-2x slower in fp32, 2-6x in bf16, eager
    # and compiled).
    maxima = logits[..., :full].unflatten(-1, (TOPK_BLOCK, blocks)).amax(-2)
    row_max = maxima.amax(-1, keepdim=True)
    if full < vocab:
        row_max = torch.maximum(row_max, logits[..., full:].amax(-1, keepdim=True))
    best = maxima.topk(k, dim=-1).indices.unsqueeze(-1)
    offsets = torch.arange(TOPK_BLOCK, device=logits.device) * blocks
    candidates = (best + offsets).flatten(-2)  # [B, S, k · TOPK_BLOCK]
    tail = torch.arange(full, vocab, device=logits.device).expand(*logits.shape[:-1], -1)
    candidates = torch.cat([candidates, tail], dim=-1)
    values, picked = logits.gather(-1, candidates).topk(k, dim=-1)
    return values, candidates.gather(-1, picked), row_max


def block_rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The sequence positions ``rows`` of a per-position ``[B, S, *]`` tensor (``None`` stays
    ``None``): an eager block's or chunk's part."""
    return None if tensor is None else tensor[:, rows]


def empty_exchanged_stats(
    rows: torch.Tensor, target: torch.Tensor | None, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised outputs shaped as :func:`exchange_stats` returns them for positions
    ``rows.shape[:-1]`` ``[B, S]``, of ``target`` ``[B, S, K]`` or the top ``topk``: the ops'
    fake kernels."""
    row = rows.new_empty(rows.shape[:-1], dtype=torch.float32)
    k = topk if target is None else target.shape[-1]
    return (
        row,
        torch.empty_like(row),
        rows.new_empty(*rows.shape[:-1], k, dtype=torch.float32),
        torch.empty_like(row),
        rows.new_empty(*rows.shape[:-1], topk, dtype=torch.int64),
    )


def _common_shift(
    row_max: torch.Tensor, sum_exp: torch.Tensor, inverse_t: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, shard_mass, factor)`` of every rank's row max and ``Σ exp(z − its max)``
    ``[R, B, S]``: the common ``shift`` (the global max, 0 where infinite), each shard's sum
    rescaled to it, and the rescaling ``factor``. A -inf shard's factor is exp(-inf) = 0,
    whatever the shift it summed with."""
    shift = _finite_or_zero(row_max.amax(0))
    factor = torch.exp((row_max - shift) * inverse_t)
    return shift, sum_exp * factor, factor


def exchange_stats(
    stats: torch.Tensor,
    target: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
    *,
    temperature: torch.Tensor | None = None,
    with_entropy: bool = False,
    topk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather this shard's statistics ``[B, S, F]`` over the group (the one collective)
    and merge every rank's into ``(shift, log_total, target_logit, entropy, topk_ids)``.

    ``shift`` ``[B, S]`` is the row's max logit over the full vocabulary, unscaled (0 where it
    is infinite), and ``log_total`` ``[B, S]`` is ``log Σ exp(z − shift / temperature)``, so
    that ``lse = shift / temperature + log_total``. ``target_logit`` ``[B, S, K]`` is the
    targets' ``z − shift / temperature`` (0 where ignored; ``K = 0`` without a target), or
    with ``topk`` that of the global top ``topk``, whose ids are ``topk_ids`` ``[B, S, topk]``
    (int64, ``topk = 0`` without); a log-prob is ``target_logit − log_total``, each term
    rounded once. ``entropy`` ``[B, S]`` is the full vocabulary's with entropy, else 0.
    Asserts, without a host sync, that every non-ignored target is owned by exactly one rank.
    """
    gathered = gather_ranks(stats, group_name)
    row_max, sum_exp = gathered[..., 0], gathered[..., 1]
    inverse_t = torch.ones_like(row_max[0]) if temperature is None else 1.0 / temperature
    shift, shard_mass, _ = _common_shift(row_max, sum_exp, inverse_t)
    total = shard_mass.sum(0)
    log_total = torch.log(total)
    if with_entropy:
        # The full softmax is the mixture of the shards' softmaxes, with weights
        # shard_mass / total; a shard's entropy is log Σe − Σe·c / Σe (c = z − max ≤ 0).
        shard_entropy = torch.log(sum_exp) - gathered[..., 2] / sum_exp
        log_weights = torch.log(shard_mass) - log_total
        entropy = _mixture_entropy(log_weights, shard_entropy, 0)
    else:
        entropy = torch.zeros_like(log_total)

    def shifted(logits: torch.Tensor) -> torch.Tensor:  # [B, S, K] x -> z − shift / T
        return (logits - shift.unsqueeze(-1)) * inverse_t.unsqueeze(-1)

    first = 3 if with_entropy else 2
    if topk:
        candidates, ids = merge_topk(gathered[..., first:], topk)
        return shift, log_total, shifted(candidates), entropy, ids
    no_ids = log_total.new_zeros(*log_total.shape, 0, dtype=torch.int64)
    if target is None:
        return shift, log_total, log_total.new_zeros(*log_total.shape, 0), entropy, no_ids
    k = target.shape[-1]
    target_logit = shifted(gathered[..., first : first + k].sum(0))
    owned_once = gathered[..., first + k : first + 2 * k].sum(0) == 1
    if ignore_index is not None:
        ignored = target == ignore_index
        owned_once = owned_once | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    assert_async(owned_once.all(), OWNERSHIP_ERROR)
    return shift, log_total, target_logit, entropy, no_ids


def filtered_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
    *,
    top_k: int,
    top_p: float,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, log_total, target_logit, threshold)`` of the top-k/top-p filtered softmax of
    ``z``: as :func:`exchange_stats` returns them, over the kept ids ``x >= threshold``
    instead of the full vocabulary (``threshold`` ``[B, S]``, unscaled like ``shift``), and
    ``target_logit`` ``-inf`` at the ids filtered out.

    ``logits`` ``[B, S, V_local]`` hold rank r's slice ``[r · V_local, (r + 1) · V_local)``
    (every rank the same width); ``target`` ``[B, S, K]`` global ids. Filtering needs whole
    rows (top-k and top-p rank each id against its row), so one all-to-all trades each
    rank's vocabulary slice of all rows for all slices of ``1 / R`` of the rows; each rank
    filters its rows and one all-gather of ``[B·S / R, 3 + K]`` statistics brings every
    row's back. Given ``block_rows`` (eager), the rows are filtered that many at a time, so
    that the selection's temporaries stay in cache.
    """
    batch, seq, width = logits.shape
    rows = batch * seq
    ranks, rank = _size_rank(group_name)
    per_rank = -(-rows // ranks)
    vocab = ranks * width

    def my_rows(per_row: torch.Tensor, fill: float) -> torch.Tensor:  # [B, S, *] -> [n, *]
        flat = per_row.reshape(rows, -1)
        padded = F.pad(flat, (0, 0, 0, per_rank * ranks - rows), value=fill)
        return padded.view(ranks, per_rank, -1)[rank]

    whole = logits.reshape(rows, width)  # [n, V] rows
    if group_name is not None:
        whole = F.pad(whole, (0, 0, 0, per_rank * ranks - rows)).contiguous()
        traded = funcol.wait_tensor(funcol.all_to_all_single(whole, None, None, group_name))
        # [R, n, V_local], rank r's slice of this rank's rows -> [n, V] in vocabulary order.
        whole = traded.view(ranks, per_rank, width).movedim(0, 1).flatten(1)
    scale = None if temperature is None else my_rows(temperature.unsqueeze(-1), 1.0)
    if block_rows is None:  # traced: one block, whatever the (symbolic) row count
        shift, log_total, threshold = _filter_rows(whole.float(), scale, top_k, top_p)
    else:
        blocks = [
            _filter_rows(
                whole[start : start + block_rows].float(),
                None if scale is None else scale[start : start + block_rows],
                top_k,
                top_p,
            )
            for start in range(0, max(per_rank, 1), block_rows)
        ]
        shift, log_total, threshold = (torch.cat(parts) for parts in zip(*blocks))
    ids = my_rows(target, 0).clamp(0, vocab - 1)
    picked = whole.gather(-1, ids).float()
    stats = torch.cat([shift, log_total, threshold, picked], dim=-1)  # [n, 3 + K]
    stats = gather_ranks(stats, group_name).flatten(0, 1)[:rows].view(batch, seq, -1)
    shift, log_total, threshold = stats[..., 0], stats[..., 1], stats[..., 2]
    picked = stats[..., 3:]
    inverse_t = 1.0 if temperature is None else 1.0 / temperature.unsqueeze(-1)
    target_logit = (picked - shift.unsqueeze(-1)) * inverse_t
    # Filtered out: log-prob -inf (a NaN row's comparisons are false: it stays NaN).
    target_logit = torch.where(picked < threshold.unsqueeze(-1), -_INF, target_logit)
    valid = (target >= 0) & (target < vocab)
    if ignore_index is not None:
        ignored = target == ignore_index
        valid = valid | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    assert_async(valid.all(), OWNERSHIP_ERROR)
    return shift, log_total, target_logit, threshold


def _size_rank(group_name: str | None) -> tuple[int, int]:
    if group_name is None:
        return 1, 0
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return group.size(), group.rank()


def _filter_rows(
    x: torch.Tensor, temperature: torch.Tensor | None, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, log_total, threshold)``, each ``[n, 1]``, of whole fp32 rows ``x`` ``[n, V]``
    (any order) with ``temperature`` ``[n, 1]``: keep the ids ``x >= threshold``.

    Top-k keeps the values at least the k-th largest (ties included). Top-p then keeps, of
    those, each id whose more probable ids (strictly more: ties go together, whatever order
    a sort leaves them in) hold less than ``top_p`` of the kept mass: the fewest most
    probable ids that reach ``top_p``. Neither sorts the row: top-k selects (block maxima),
    and top-p looks among the top k, or without a top-k finds its threshold digit by digit.
    """
    inverse_t = 1.0 if temperature is None else 1.0 / temperature
    if top_k >= x.shape[-1]:
        shift = _finite_or_zero(x.amax(-1, keepdim=True))
        z = (x - shift) * inverse_t
        threshold = torch.full_like(shift, -_INF)
        if top_p < 1.0:
            threshold = _nucleus_threshold(x, torch.softmax(z, dim=-1), top_p)
        log_total = torch.logsumexp(torch.where(x < threshold, -_INF, z), -1, keepdim=True)
        return shift, log_total, threshold
    # Every kept id is one of the top k or tied with the k-th value: the masses come from
    # the k values and a count of those ties, with no exponential over the row.
    top, _, row_max = local_topk(x, top_k)  # decreasing
    shift = _finite_or_zero(row_max)
    top_z = (top - shift) * inverse_t
    kth = top[..., -1:]
    beyond = (x >= kth).sum(-1, keepdim=True) - top_k  # ties of the k-th outside the k
    log_ties = torch.where(beyond > 0, torch.log(beyond) + top_z[..., -1:], -_INF)

    def log_mass(threshold: torch.Tensor) -> torch.Tensor:  # log Σ exp(z) over x >= threshold
        listed = torch.logsumexp(torch.where(top < threshold, -_INF, top_z), -1, keepdim=True)
        return torch.logaddexp(listed, torch.where(threshold == kth, log_ties, -_INF))

    threshold = kth
    if top_p < 1.0:
        # A tied value's first entry has the mass strictly above it.
        probs = torch.exp(top_z - log_mass(kth))
        count = (probs.cumsum(-1) - probs < top_p).sum(-1, keepdim=True)
        # The first always counts (mass above it 0); the clamp keeps a NaN row in range.
        threshold = top.gather(-1, count.clamp(min=1) - 1)
    return shift, log_mass(threshold), threshold


_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
# The radix select's digits, most significant first: 3 passes of at most 2048 bins (a pass
# costs a scatter-add per entry, its bins a few ops per bin).
_DIGITS = (11, 11, 10)


def _ordered_key(bits: torch.Tensor) -> torch.Tensor:
    """int32 keys of fp32 bit patterns ``bits`` that order as the values (NaN beyond ±inf):
    negative floats order in reverse of their bits. Its own inverse."""
    return torch.where(bits < 0, bits ^ _INT32_MAX, bits)


def _nucleus_threshold(x: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest value ``v`` of each row of fp32 ``x`` ``[n, V]`` whose strictly larger
    values hold less than ``top_p`` of ``probs``, ``[n, 1]``, without a sort.

    Equivalently, the largest value with at least ``top_p`` at or above it. A radix select
    over the values' order-preserving int32 keys: each pass splits the bucket of keys found
    so far into ``2^digit`` sub-buckets and bins ``probs`` by sub-bucket (one scatter-add,
    keys outside the bucket clamped to a bin below it or above it); the mass at or above a
    sub-bucket is a running sum from the top, and the next bucket is the last one whose mass
    at or above reaches ``top_p``. Three passes fix all 32 bits: the exact value, ties
    together. Where no bucket reaches ``top_p`` (the mass falls short by rounding) the
    row's minimum keeps the whole row; a NaN row gets NaN.
    """
    key = _ordered_key(x.view(torch.int32))
    rows = x.shape[:-1]
    # The bucket of keys [bucket, bucket + 2^span): int64, so that its bounds never wrap.
    bucket = torch.full((*rows, 1), _INT32_MIN, dtype=torch.int64, device=x.device)
    span = 32
    for digit in _DIGITS:
        low = span - digit
        width = 1 << digit
        first = (bucket >> low) - 1  # sub-bucket index of bin 0: keys below the bucket
        clamped = key
        if span < 32:
            below = (bucket - (1 << low)).clamp(min=_INT32_MIN).int()
            above = (bucket + (1 << span) + (1 << low) - 1).clamp(max=_INT32_MAX).int()
            clamped = key.clamp(below, above)
        bins = ((clamped >> low) - first.int()).long()  # [n, V] in [0, width + 1]
        mass = probs.new_zeros(*rows, width + 2).scatter_add(-1, bins, probs)
        at_or_above = mass.flip(-1).cumsum(-1).flip(-1)[..., 1 : width + 1]
        # Non-increasing along the sub-buckets, even rounded: the last that reaches top_p.
        reached = (at_or_above >= top_p).sum(-1, keepdim=True)
        bucket = (first + reached.clamp(min=1)) << low
        span = low
    row_min = _ordered_key(x.amin(-1, keepdim=True).view(torch.int32))
    return _ordered_key(torch.maximum(bucket.int(), row_min)).view(torch.float32)


def cross_entropy_stats(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    *,
    eager: bool = False,
    workspace: torch.Tensor | None = None,
    spare: torch.Tensor | None = None,
) -> torch.Tensor:
    """This shard's statistics for :func:`exchange_cross_entropy`, fp32 ``[B, S, 5]``:
    ``[max x, Σ exp(u), max y, Σ exp(v), Σ exp(v) · (−u)]`` of the logits ``x`` and the target
    logits ``y`` (``[B, S, V_local]`` each), with ``u = (x − max x) / T`` and
    ``v = (y − max y) / T`` (each max taken as 0 where it is infinite, as
    :func:`_finite_or_zero` does), exponentiated in :func:`_unit`'s units.

    The last sum's terms are non-negative and 0 wherever ``exp(v)`` is 0: vocabulary padding
    (``-inf`` in both) adds 0, while target mass on a ``-inf`` logit makes the sum, and the
    cross-entropy, ``inf``. Traced, one pass over both inputs; ``eager``, in place in the
    fp32 blocks ``workspace`` and ``spare`` when given, as :func:`local_stats`.
    """
    x, y = _promoted(logits), _promoted(target_logits)
    # As _shifted_stats: ATen reduces 16-bit rows slowly, so eager blocks are converted
    # first; the target's only for its max, since spare holds exp(u) before its turn.
    if eager and x.dtype != torch.float32:
        x = workspace = _into_or_fresh(workspace, x)
    y_for_max = _into_or_fresh(spare, y) if eager and y.dtype != torch.float32 else y
    x_max, y_max = (
        (t.amax(-1, keepdim=True) if eager else _row_max(t)).float() for t in (x, y_for_max)
    )
    unit = _unit(eager)
    (scale,) = _per_row(eager, _exponent_scale(temperature, unit))
    exp_op = _exp_op(eager)
    centred = _scaled(eager, _minus(x, _finite_or_zero(x_max), workspace), scale)
    # spare holds exp(u) until its sum is taken, then the target's exponentials.
    total = getattr(torch, exp_op)(centred, out=spare)
    total = total.sum(-1, keepdim=True) if eager else _row_sum(total, ENTROPY_SLICES)
    target_exps = _inplace(
        eager, _scaled(eager, _minus(y, _finite_or_zero(y_max), spare), scale), exp_op
    )
    if eager:
        # −u · exp(v) is NaN only where exp(v) = 0 and u = -inf: a term that is 0 (a NaN
        # logit still gives NaN, through the maxima).
        gaps = -centred.mul_(target_exps).nansum(-1, keepdim=True)
        target_total = target_exps.sum(-1, keepdim=True)
    else:
        gaps = torch.where(target_exps == 0, 0.0, target_exps * -centred)
        gaps, target_total = _row_sum(gaps, ENTROPY_SLICES), _row_sum(target_exps, ENTROPY_SLICES)
    return torch.cat([x_max, total, y_max, target_total, gaps * unit], dim=-1)


def exchange_cross_entropy(
    stats: torch.Tensor, group_name: str | None, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather :func:`cross_entropy_stats` (the one collective) and merge every rank's into
    ``(shift, log_total, target_shift, target_log_total, cross_entropy)``, fp32 ``[B, S]``
    each: ``lse = shift / T + log_total`` of the logits, the same of the target logits, and
    ``H(p, q) = −Σ p log q`` with ``p = softmax(y / T)`` and ``q = softmax(x / T)``.

    ``H(p, q) = log_total + Σ p · (shift − x) / T``: both terms are non-negative (each shard's
    part of the second is its own sum of gaps to its own max, rescaled to the common shifts,
    plus its target mass times the distance between its max and the global one), so nothing
    cancels however large the logits are.
    """
    gathered = gather_ranks(stats, group_name)
    inverse_t = 1.0 if temperature is None else 1.0 / temperature
    shift, mass, _ = _common_shift(gathered[..., 0], gathered[..., 1], inverse_t)
    target_shift, target_mass, target_factor = _common_shift(
        gathered[..., 2], gathered[..., 3], inverse_t
    )
    target_total = target_mass.sum(0)
    climb = (shift - _finite_or_zero(gathered[..., 0])) * inverse_t
    gaps = gathered[..., 4] * target_factor + torch.where(target_mass == 0, 0.0, target_mass * climb)
    log_total = torch.log(mass.sum(0))
    cross_entropy = log_total + gaps.sum(0) / target_total
    return shift, log_total, target_shift, torch.log(target_total), cross_entropy


def grad_cross_entropy(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    log_total: torch.Tensor,
    target_shift: torch.Tensor,
    target_log_total: torch.Tensor,
    cross_entropy: torch.Tensor,
    *,
    wrt_target: bool,
    eager: bool = False,
    workspace: torch.Tensor | None = None,
    spare: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g · dH(p, q)``, fp32 ``[B, S, V_local]``, with respect to the logits,
    ``g · (q − p) / T``, or (``wrt_target``) the target logits,
    ``g · p · (−log q − H) / T``; no collective. ``p`` is 0 where ``y`` is ``-inf``, and so
    is the target gradient there, even where ``−log q`` is ``inf``. ``eager``: in place in
    the fp32 blocks ``workspace`` (which the result is) and ``spare`` when given.

    Each exponential is scaled by its own per-row factor, ``g`` included, rather than ``g``
    scaling ``q − p``: traced, a ``[B, S, V_local]`` term free of ``g`` would let the
    partitioner compute it in the forward and save it (one buffer instead of two inputs),
    so the forward would write a gradient-sized buffer and, for 16-bit logits, save twice
    their bytes.
    """
    inverse_t = 1.0 if temperature is None else 1.0 / temperature
    row_scale = grad * inverse_t
    unit = _unit(eager)
    exp_op = _exp_op(eager)

    def exps(z, rows_shift, log_norm, factor, buffer):  # e^((z − shift) / T − log_norm) · factor
        scale, coefficient = _per_row(
            eager, _exponent_scale(temperature, unit), factor * torch.exp(-log_norm)
        )
        exponents = _scaled(eager, _minus(_promoted(z), rows_shift.unsqueeze(-1), buffer), scale)
        return _inplace(eager, _inplace(eager, exponents, exp_op), "mul", coefficient)

    if not wrt_target:
        q_terms = exps(logits, shift, log_total, row_scale, workspace)
        p_terms = exps(target_logits, target_shift, target_log_total, row_scale, spare)
        return _inplace(eager, q_terms, "sub", p_terms)
    # g · p · (−log q − H) / T = g · p / T · (log_total − H − u), u = (x − shift) / T in nats.
    inverse_rows, offset = _per_row(eager, inverse_t, log_total - cross_entropy)
    surprise = _scaled(eager, _minus(_promoted(logits), shift.unsqueeze(-1), workspace), inverse_rows)
    surprise = _inplace(eager, _inplace(eager, surprise, "neg"), "add", offset)
    p_terms = exps(target_logits, target_shift, target_log_total, row_scale, spare)
    return _inplace(eager, _inplace(eager, surprise, "mul", p_terms), "masked_fill", p_terms == 0, 0.0)


def gather_ranks(stats: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """Every rank's ``stats`` ``[B, ...]``, stacked as ``[R, B, ...]`` (one all-gather)."""
    if group_name is None:
        return stats.unsqueeze(0)
    return all_gather_single(stats, 0, group_name).unflatten(0, (-1, stats.shape[0]))


def merge_topk(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top ``k`` ``(logits [B, S, k], int64 ids [B, S, k])``, in decreasing order,
    of every rank's :func:`topk_stats` candidates ``[R, B, S, 2k]``."""
    # [B, S, R · k]: every rank's candidates, of which the best k are global.
    candidates, ids = gathered.movedim(0, -2).split(k, dim=-1)
    candidates, ids = candidates.flatten(-2), ids.flatten(-2)
    if gathered.shape[0] > 1:
        best = candidates.topk(k, dim=-1).indices
        candidates, ids = candidates.gather(-1, best), ids.gather(-1, best)
    return candidates, ids.long()


def grad_logits(
    grad_log_total: torch.Tensor,
    grad_target_logit: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor | None,
    shift: torch.Tensor,
    log_total: torch.Tensor,
    vocab_start: int,
    ignore_index: int | None,
    *,
    temperature: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    eager: bool = False,
    workspace: torch.Tensor | None = None,
    spare: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d(log_total, target_logit, entropy)/d logits`` (as :func:`exchange_stats` returns
    them) applied to the incoming gradients, ``[B, S, V_local]``, formed in fp32 and rounded
    once.

    With ``p = softmax(z)``, and ``shift`` a constant: ``d log_total/dz = p``,
    ``d target_logit_k/dz = onehot(target_k)``, ``d H/dz = −p · (log p + H)``, and
    ``dz/d logits = 1 / temperature``. For a token log-prob (``g_log_total = −g``,
    ``g_target = g``) this is ``g · (onehot − p)``. Rows whose targets are all ignored get
    exactly 0, whatever their logits hold. With a ``threshold`` ``[B, S]`` (of
    :func:`filtered_stats`), ``p`` is the filtered softmax: 0 where ``logits < threshold``.

    ``eager`` (op-by-op calls on a block): the fp32 block (in ``workspace``, and ``spare``
    with entropy, when given), updated in place, with the one-hot terms scatter-added; the
    caller rounds it by copying it into the gradient. Traced for Inductor: the logits'
    dtype, as one elementwise pass for the softmax terms and then a scatter of the exact
    values at the K target positions of each row, so that no pass over the vocabulary
    compares against K ids.
    """
    softmax_terms = functools.partial(
        _softmax_terms,
        shift=shift,
        log_total=log_total,
        temperature=temperature,
        grad_log_total=grad_log_total,
        grad_entropy=grad_entropy,
        entropy=entropy,
    )
    grad = softmax_terms(_promoted(logits), eager=eager, workspace=workspace, spare=spare)
    grad = _filtered_out(grad, logits, threshold, eager=eager)
    if target is None:
        return grad if eager else grad.to(logits.dtype)
    index, grad_target, all_ignored = target_terms(
        grad_target_logit, target, vocab_start, logits.shape[-1], ignore_index, temperature
    )
    if eager:
        return add_target_terms_(grad, index, grad_target, all_ignored)
    # The exact gradient at each scattered position (index 0 stands in for ids this shard
    # does not own, and gets its own exact value): its softmax term plus the one-hot terms
    # of every id that lands there (ignored ones add 0).
    at_logits = logits.gather(-1, index)
    at_index = _filtered_out(softmax_terms(at_logits.float(), eager=False), at_logits, threshold)
    same = index.unsqueeze(-1) == index.unsqueeze(-2)  # [B, S, K, K]
    at_index = at_index + torch.where(same, grad_target.unsqueeze(-2), 0.0).sum(-1)
    dense = _zero_rows(grad, all_ignored, eager=False).to(logits.dtype)
    exact = _zero_rows(at_index, all_ignored, eager=False).to(logits.dtype)
    return dense.scatter(-1, index, exact)


def target_terms(
    grad_target_logit: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab: int,
    ignore_index: int | None,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The one-hot terms of :func:`grad_logits`: ``(index, grad_target, all_ignored)``, the
    ids' local index ``[B, S, K]`` (0 where not owned), the gradient to add there (0 where
    not owned or ignored) and the rows whose targets are all ignored ``[B, S, 1]`` (``None``
    without ``ignore_index`` or without targets, K = 0). Eager kernels form them once for all
    rows."""
    index, owned = _local_ids(target, vocab_start, vocab)
    all_ignored = None
    if ignore_index is not None:
        owned = owned & (target != ignore_index)
        if target.shape[-1]:
            all_ignored = (target == ignore_index).all(-1, keepdim=True)
    grad_target = torch.where(owned, grad_target_logit, 0.0)
    if temperature is not None:
        grad_target = grad_target * (1.0 / temperature.unsqueeze(-1))
    return index, grad_target, all_ignored


def add_target_terms_(
    grad: torch.Tensor,
    index: torch.Tensor,
    grad_target: torch.Tensor,
    all_ignored: torch.Tensor | None,
) -> torch.Tensor:
    """Eager, in place on the fp32 block ``grad``: the one-hot terms of :func:`target_terms`
    scatter-added, and the rows whose targets are all ignored set to 0."""
    grad.scatter_add_(-1, index, grad_target)
    return _zero_rows(grad, all_ignored, eager=True)


def _softmax_terms(
    x, *, shift, log_total, temperature, grad_log_total, grad_entropy, entropy, eager,
    workspace=None, spare=None
):
    """fp32 ``p · (g_lt − g_H · (H + log p)) / temperature`` (``g_H`` term only with entropy)
    for logits ``x`` ``[B, S, *]`` of any width: the whole vocabulary, or a few gathered
    entries.

    In exponents ``c = (x − shift) / (unit · T) ≤ 0`` (``shift``: the unscaled row max, so
    that the subtraction is exact where it matters; ``unit``: :func:`_unit`'s nats),
    ``p = e^(unit · c) / total``, and ``log p = unit · c − log_total``: the normaliser folds
    into per-row factors, so ``p`` keeps its precision however large the logits are, at no
    extra pass. The entropy adds a multiply-add of ``c`` with per-row constants.
    """
    # Per-row factor of every term: 1 / (total · T).
    factor = torch.exp(-log_total) * (1.0 if temperature is None else 1.0 / temperature)
    unit = _unit(eager)
    scale = _exponent_scale(temperature, unit)
    if grad_entropy is None:
        shift, scale, coefficient = _per_row(eager, shift, scale, grad_log_total * factor)
        exponents = _scaled(eager, _minus(x, shift, workspace), scale)
        return _inplace(eager, _inplace(eager, exponents, _exp_op(eager)), "mul", coefficient)
    offset = grad_log_total - grad_entropy * (entropy - log_total)
    shift, scale, slope, intercept = _per_row(
        eager, shift, scale, grad_entropy * (-unit) * factor, offset * factor
    )
    exponents = _scaled(eager, _minus(x, shift, workspace), scale)
    # The floor keeps the weight finite, so that entries of p = 0 (-inf logits, vocabulary
    # padding) get 0 · weight = 0, not NaN.
    exponents = _inplace(eager, exponents, "clamp", min=_EXPONENT_FLOOR)
    exps = getattr(torch, _exp_op(eager))(exponents, out=spare)
    weight = _inplace(eager, exponents, "mul", slope)
    return _inplace(eager, _inplace(eager, weight, "add", intercept), "mul", exps)


def _per_row(eager: bool, *values: torch.Tensor | float) -> list[torch.Tensor | float]:
    """``values`` (``[B, S]`` tensors or floats) as ``[B, S, 1]`` factors of a pass over the
    vocabulary. Traced, the tensors are stacked into one buffer: Inductor would inline their
    arithmetic into the pass, where the C++ compiler recomputes it for every vector of the
    row (it cannot hoist loads past the gradient's stores): the entropy's backward measured
    7% faster on the CPU. Triton keeps them in registers, so other devices skip the buffer."""
    rows = [value for value in values if isinstance(value, torch.Tensor)]
    if not eager and len(rows) > 1 and rows[0].is_cpu:
        rows = torch.stack(rows, dim=-1).unbind(-1)
    rows = iter(rows)
    return [next(rows).unsqueeze(-1) if isinstance(value, torch.Tensor) else value for value in values]


def _filtered_out(grad, logits, threshold, eager=False):
    """``grad`` with 0 at the ids that the filter drops, ``logits < threshold``."""
    if threshold is None:
        return grad
    return _inplace(eager, grad, "masked_fill", logits < threshold.unsqueeze(-1), 0.0)


def _zero_rows(grad, all_ignored, eager):
    """``grad`` with the rows whose targets are all ignored set to 0."""
    if all_ignored is None:
        return grad
    return _inplace(eager, grad, "masked_fill", all_ignored, 0.0)


def _inplace(eager: bool, tensor: torch.Tensor, method: str, *args, **kwargs) -> torch.Tensor:
    """``tensor.method_(...)`` eagerly (``tensor`` must be a fresh temporary), else the
    functional ``tensor.method(...)`` that tracing for Inductor requires."""
    return getattr(tensor, method + "_" if eager else method)(*args, **kwargs)
