"""Log-probs under a sampler's top-k/top-p filtered distribution (docs/filtering.md).

Filtering ranks each id against its whole row, so one all-to-all trades each rank's
vocabulary slice of all rows for all slices of ``1 / R`` of the rows; each rank filters its
rows without sorting them (top-k by block maxima, top-p by a radix select), and one
all-gather of per-row statistics brings every row's back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_logprob import _comm
from compiled_logprob._math import merge
from compiled_logprob._math.kernels import INF, finite_or_zero
from compiled_logprob._math.merge import verdict_of
from compiled_logprob._math.topk import local_topk


def filtered_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor | None,
    group_name: str | None,
    ignore_index: int | None,
    *,
    top_k: int,
    top_p: float,
    rows_per_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, log_norm, target_logit, threshold, verdict)`` of the top-k/top-p filtered softmax of
    ``z``: as :func:`exchange_stats` returns them, over the kept ids ``x >= threshold``
    instead of the full vocabulary (``threshold`` ``[B, S]``, unscaled like ``shift``), and
    ``target_logit`` ``-inf`` at the ids filtered out.

    ``logits`` ``[B, S, V_local]`` hold rank r's slice ``[r · V_local, (r + 1) · V_local)``
    (every rank the same width); ``target`` ``[B, S, K]`` global ids. Filtering needs whole
    rows (top-k and top-p rank each id against its row), so one all-to-all trades each
    rank's vocabulary slice of all rows for all slices of ``1 / R`` of the rows; each rank
    filters its rows and one all-gather of ``[B·S / R, 3 + K + R·A]`` statistics brings every
    row's back, with every row's ids and temperature as each rank holds them (``A`` per row),
    which every rank compares alike: the verdict. Given ``rows_per_block`` (eager), the rows are filtered that many at a time, so
    that the selection's temporaries stay in cache.
    """
    batch, seq, width = logits.shape
    rows = batch * seq
    ranks, rank = _comm.named_size_rank(group_name)
    per_rank = -(-rows // ranks)
    vocab = ranks * width

    def my_rows(per_row: torch.Tensor, fill: float) -> torch.Tensor:  # [B, S, *] -> [n, *]
        flat = per_row.reshape(rows, -1)
        padded = F.pad(flat, (0, 0, 0, per_rank * ranks - rows), value=fill)
        return padded.view(ranks, per_rank, -1)[rank]

    whole = logits.reshape(rows, width)  # [n, V] rows
    if group_name is not None:
        whole = F.pad(whole, (0, 0, 0, per_rank * ranks - rows))
        traded = _comm.all_to_all(whole, group_name)
        # [R, n, V_local], rank r's slice of this rank's rows -> [n, V] in vocabulary order.
        whole = traded.view(ranks, per_rank, width).movedim(0, 1).flatten(1)
    scale = None if temperature is None else my_rows(temperature.unsqueeze(-1), 1.0)
    if rows_per_block is None:  # traced: one block, whatever the (symbolic) row count
        shift, log_norm, threshold = _filter_rows(whole.float(), scale, top_k, top_p)
    else:
        blocks = [
            _filter_rows(
                whole[start : start + rows_per_block].float(),
                None if scale is None else scale[start : start + rows_per_block],
                top_k,
                top_p,
            )
            for start in range(0, max(per_rank, 1), rows_per_block)
        ]
        shift, log_norm, threshold = (torch.cat(parts) for parts in zip(*blocks))
    picked = whole.gather(-1, my_rows(target, 0).clamp(0, vocab - 1)).float()
    k = target.shape[-1]
    # Every row's ids (and temperature) as this rank holds them, R · A columns per row of
    # its own: after the gather every rank compares every rank's, and reaches one verdict.
    agreed = torch.cat(merge.agreed_columns(target, temperature), dim=-1)  # [B, S, A]
    table = F.pad(agreed.reshape(rows, -1), (0, 0, 0, per_rank * ranks - rows))
    table = table.view(ranks, per_rank, -1).movedim(0, 1).flatten(1)  # [n, R · A]
    gathered = _comm.gather_ranks(torch.cat([shift, log_norm, threshold, picked, table], -1), group_name)
    stats = gathered[..., : 3 + k].flatten(0, 1)[:rows].view(batch, seq, -1)
    shift, log_norm, threshold = stats[..., 0], stats[..., 1], stats[..., 2]
    picked = stats[..., 3:]
    # [R sources, n, R · A] -> where sources differ, back in row order: [B, S, A].
    disagree = merge.differ(gathered[..., 3 + k :].unsqueeze(-1)).view(per_rank, ranks, -1)
    disagree = disagree.movedim(1, 0).flatten(0, 1)[:rows].view(batch, seq, -1)
    ids_differ = disagree[..., :k].any(-1)
    temperatures_differ = None if temperature is None else disagree[..., k]
    inverse_t: float | torch.Tensor = (
        1.0 if temperature is None else 1.0 / temperature.unsqueeze(-1)
    )
    target_logit = (picked - shift.unsqueeze(-1)) * inverse_t
    # Filtered out: log-prob -inf (a NaN row's comparisons are false: it stays NaN).
    target_logit = torch.where(picked < threshold.unsqueeze(-1), -INF, target_logit)
    valid = (target >= 0) & (target < vocab)
    if ignore_index is not None:
        ignored = target == ignore_index
        valid = valid | ignored
        target_logit = torch.where(ignored, 0.0, target_logit)
    verdict = verdict_of(
        log_norm,
        not_owned=~valid.all(-1),
        ids_differ=ids_differ,
        temperatures_differ=temperatures_differ,
    )
    return shift, log_norm, target_logit, threshold, verdict


def _filter_rows(
    x: torch.Tensor, temperature: torch.Tensor | None, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift, log_norm, threshold)``, each ``[n, 1]``, of whole fp32 rows ``x`` ``[n, V]``
    (any order) with ``temperature`` ``[n, 1]``: keep the ids ``x >= threshold``.

    Top-k keeps the values at least the k-th largest (ties included). Top-p then keeps, of
    those, each id whose more probable ids (strictly more: ties go together, whatever order
    a sort leaves them in) hold less than ``top_p`` of the kept mass: the fewest most
    probable ids that reach ``top_p``. Neither sorts the row: top-k selects (block maxima),
    and top-p looks among the top k, or without a top-k finds its threshold digit by digit.
    """
    inverse_t: float | torch.Tensor = 1.0 if temperature is None else 1.0 / temperature
    if top_k >= x.shape[-1]:
        shift = finite_or_zero(x.amax(-1, keepdim=True))
        z = (x - shift) * inverse_t
        threshold = torch.full_like(shift, -INF)
        if top_p < 1.0:
            threshold = _nucleus_threshold(x, torch.softmax(z, dim=-1), top_p)
        log_norm = torch.logsumexp(torch.where(x < threshold, -INF, z), -1, keepdim=True)
        return shift, log_norm, threshold
    # Every kept id is one of the top k or tied with the k-th value: the masses come from
    # the k values and a count of those ties, with no exponential over the row.
    top, _, row_max = local_topk(x, top_k)  # decreasing
    shift = finite_or_zero(row_max)
    top_z = (top - shift) * inverse_t
    kth = top[..., -1:]
    beyond = (x >= kth).sum(-1, keepdim=True) - top_k  # ties of the k-th outside the k
    log_ties = torch.where(beyond > 0, torch.log(beyond) + top_z[..., -1:], -INF)

    def log_mass(threshold: torch.Tensor) -> torch.Tensor:  # log Σ exp(z) over x >= threshold
        listed = torch.logsumexp(torch.where(top < threshold, -INF, top_z), -1, keepdim=True)
        return torch.logaddexp(listed, torch.where(threshold == kth, log_ties, -INF))

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
