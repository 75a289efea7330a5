"""Vocab-parallel token log-probs: the functional API.

Shape legend: ``B`` batch, ``S`` sequence (this rank's part of it), ``V`` the full
vocabulary, ``V_local`` this rank's vocabulary slice ``[vocab_start, vocab_start + V_local)``.

Every function takes the logits of one vocabulary shard and returns values defined over the
*full* vocabulary: only per-row ``[B, S]`` statistics cross ranks (one all-gather per call,
chunked or not). The backward of the per-row results (log-probs, logsumexp) communicates
nothing; only the sharded log-softmax, whose every entry depends on every shard, all-reduces
one ``[B, S]`` vector in backward. All of it traces whole under
``torch.compile(fullgraph=True)``, performs no host synchronisation (so it can be captured
in CUDA graphs) and needs no ``torch.distributed`` at all when ``group`` is ``None``.
Top-k/top-p filtering needs whole rows: it adds one all-to-all of the logits.
"""

from __future__ import annotations

import numbers
import operator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from compiled_logprob import _math, _ops

__all__ = [
    "token_logprobs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
]


def _group_name(group: dist.ProcessGroup | None) -> str | None:
    """The name the ops take, or ``None`` when the vocabulary is not sharded."""
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if group.size() == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError(
            "a process group was passed but torch.distributed is not initialised (or was "
            "destroyed): call torch.distributed.init_process_group(...) first, or pass "
            "group=None for an unsharded vocabulary"
        )
    return group.group_name


def _as_batch(tensor: torch.Tensor, kept_dims: int) -> torch.Tensor:
    """Fold all leading dims but the last ``kept_dims`` into one batch dim (adding one if none):
    ``[..., S, V_local]`` -> ``[B, S, V_local]`` with ``kept_dims=2``."""
    if tensor.dim() == kept_dims:
        return tensor.unsqueeze(0)
    return tensor.flatten(0, -kept_dims - 1)


def _as_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an int, for an op's int argument: ints and integer scalars (numpy's too),
    not bools, floats or tensors (a tensor would be read on the host). A Python int is
    returned as it is: under torch.compile, ``operator.index`` would specialise a dynamic
    one (such as ``max_seqlen``), one recompile per value."""
    if not isinstance(value, int) or isinstance(value, bool):
        if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
            hint = "; pass a Python int (a tensor would be read on the host)"
            raise TypeError(
                f"{name} must be an int, got {value!r:.80}" + hint * isinstance(value, torch.Tensor)
            )
        value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def _validate_logits(
    logits: torch.Tensor, chunk_size: int | None, name: str = "logits"
) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got dtype {logits.dtype}; "
            "pass the model's raw (vocab-parallel) logits"
        )
    if logits.dim() < 2:
        raise ValueError(
            f"{name} must have shape [..., S, V_local], got shape {tuple(logits.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            f"this rank's vocabulary shard is empty ({name} shape {tuple(logits.shape)}): "
            "shard a vocabulary over at most V ranks"
        )
    if chunk_size is not None:
        _as_int(chunk_size, "chunk_size", minimum=1)


def _validate_token_ids(ids: torch.Tensor, name: str) -> None:
    """``ids`` must be an int64/int32 tensor: gather and index_select take nothing else."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{name} must hold integer token ids (int64 or int32), got dtype {ids.dtype}; "
            f"pass {name}.long()"
        )


def _validate_target(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int | None
) -> tuple[int, int | None]:
    """Checks ``target`` against ``logits`` ``[..., S, *]``; returns ``(vocab_start,
    ignore_index)`` as Python ints."""
    _validate_token_ids(target, "target")
    positions = logits.shape[:-1]
    if target.shape != positions and not (
        target.dim() == logits.dim() and target.shape[:-1] == positions
    ):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' leading shape "
            f"{tuple(positions)} (logits {tuple(logits.shape)} are [..., S, V_local]), or be "
            f"{tuple(positions)} + (K,) for K ids per position"
        )
    if target.device != logits.device:
        raise ValueError(
            f"target is on {target.device} but logits are on {logits.device}; "
            "move both to the same device"
        )
    vocab_start = _as_int(vocab_start, "vocab_start", minimum=0)
    if ignore_index is not None:
        ignore_index = _as_int(ignore_index, "ignore_index")
        info = torch.iinfo(target.dtype)
        if not info.min <= ignore_index <= info.max:
            raise ValueError(
                f"ignore_index={ignore_index} does not fit the target's dtype {target.dtype} "
                f"(it would wrap around and ignore another id): pass target.long()"
            )
    return vocab_start, ignore_index


# Top-k ids travel beside the candidates' values as fp32, exact up to 2**24.
_MAX_TOPK_VOCAB = 1 << 24
# fp32 temperatures: the smallest normal one (below it 1 / T overflows), and the largest.
_TEMPERATURE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def _check_float_temperature(temperature: object, accepted: str) -> None:
    """A number ``temperature`` must be a normal finite fp32 one: the math divides by it in
    fp32, and its reciprocal must not overflow. ``accepted`` says what the caller takes.
    (Python compares a huge int with a float exactly: no OverflowError here.)"""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be {accepted}, got {temperature!r:.80}")
    low, high = _TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ValueError(
            f"temperature must be a finite fp32 number >= {low:.3g} (1 / temperature must "
            f"not overflow), got {temperature!r:.80}"
        )


def _fp32_temperature(temperature: float | torch.Tensor) -> float | torch.Tensor:
    """A validated temperature as the ops see it: a float, or a tensor in fp32."""
    return temperature.float() if isinstance(temperature, torch.Tensor) else temperature


def _temperature_rows(
    temperature: float | torch.Tensor,
    rows_shape: torch.Size,
    device: torch.device,
    name: str = "logits",
) -> torch.Tensor | None:
    """``None`` for 1, else fp32 ``[B, S]`` (a broadcast view, nothing copied) for the
    positions ``rows_shape`` of the input ``name``."""
    low, high = _TEMPERATURE_RANGE
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float tensor, got dtype {temperature.dtype}")
        if temperature.device != device:
            raise ValueError(
                f"temperature is on {temperature.device} but {name} are on {device}; "
                f"move it to the {name}' device"
            )
        if temperature.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "temperature requires grad, but no gradient flows to it: pass "
                "temperature.detach()"
            )
        try:
            rows = temperature.float().expand(rows_shape)
        except RuntimeError:
            raise ValueError(
                f"temperature of shape {tuple(temperature.shape)} does not broadcast to the "
                f"positions {tuple(rows_shape)}: pass a float, or a tensor of shape [..., S] "
                "or [..., 1] (one temperature per row)"
            ) from None
        _math.assert_async(
            ((rows >= low) & (rows <= high)).all(),
            f"temperature must be a finite fp32 number >= {low:.3g} everywhere",
        )
    else:
        _check_float_temperature(temperature, "a float or a tensor")
        if temperature == 1:
            return None
        rows = torch.full((), float(temperature), device=device).expand(rows_shape)
    return _as_batch(rows, 1)


def _stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None,
    chunk_size: int | None,
    temperature: float | torch.Tensor,
    vocab_start: int = 0,
    ignore_index: int | None = None,
    with_entropy: bool = False,
    topk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shift [..., S], log_total [..., S], target_logit [..., S, K], entropy [..., S],
    topk_ids [..., S, topk])`` of ``target [..., S, K]``, or of the top ``topk`` ids when
    ``target`` is ``None``: ``lse = shift / temperature + log_total`` and a log-prob is
    ``target_logit − log_total`` (``_math.exchange_stats``)."""
    rows_shape = logits.shape[:-1]
    args = (
        _as_batch(logits, 2),
        None if target is None else _as_batch(target, 2),
        _temperature_rows(temperature, rows_shape, logits.device),
    )
    shift, log_total, target_logit, entropy, topk_ids = _ops.vocab_parallel_stats(
        *args,
        vocab_start=_as_int(vocab_start, "vocab_start"),
        group_name=_group_name(group),
        ignore_index=None if ignore_index is None else _as_int(ignore_index, "ignore_index"),
        with_entropy=with_entropy,
        topk=_as_int(topk, "k"),
        chunk_size=None if chunk_size is None else _as_int(chunk_size, "chunk_size"),
    )
    return (
        shift.view(rows_shape),
        log_total.view(rows_shape),
        target_logit.view(*rows_shape, target_logit.shape[-1]),
        entropy.view(rows_shape),
        topk_ids.view(*rows_shape, topk),
    )


def _filter_options(
    top_k: int | None,
    top_p: float,
    logits: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    return_entropy: bool,
) -> tuple[int, float] | None:
    """Validated ``(top_k, top_p)`` (``top_k`` capped at the full vocabulary), or ``None``
    when they filter nothing."""
    if top_k is not None:
        top_k = _as_int(top_k, "top_k", minimum=1)
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a float in (0, 1], got {top_p!r:.80}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every id), got {top_p!r}")
    if top_k is None and top_p == 1:
        return None
    if return_entropy:
        raise ValueError(
            "return_entropy is not supported with top_k/top_p: call vocab_parallel_entropy for "
            "the unfiltered distribution's entropy"
        )
    width = logits.shape[-1]
    size, rank = (1, 0) if _group_name(group) is None else (group.size(), group.rank())
    if vocab_start != rank * width:
        raise ValueError(
            f"top_k/top_p need the vocabulary split evenly in rank order (rank r holds ids "
            f"[r * V_local, (r + 1) * V_local), as NeMo-RL's layout), but rank {rank} of the "
            f"group holds [{vocab_start}, {vocab_start + width}): split the vocabulary evenly "
            "(pad it to a multiple of the TP size with -inf logits)"
        )
    return min(top_k or size * width, size * width), float(top_p)


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token under the softmax over the full vocabulary.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1).gather(-1, target[..., None])[..., 0]``
    where ``full_logits`` is the concatenation of every rank's shard along the vocabulary.

    Args:
        logits: ``[..., S, V_local]``, any floating dtype; the math runs in fp32.
        target: ``[..., S]`` global token ids (integer dtype), or ``[..., S, K]`` for the
            log-probs of ``K`` ids per position (distillation).
        vocab_start: first global vocabulary id of this rank's shard.
        group: the vocab-parallel (tensor-parallel) group; ``None`` or a group of size 1 means
            the vocabulary is not sharded.
        chunk_size: process at most this many positions at a time, so that no eager
            temporary exceeds ``O(B * chunk_size * V_local)`` (compiled, the fused pass keeps
            no such temporary at all). Still one collective per call.
        ignore_index: targets equal to it get log-prob 0 and no gradient.
        temperature: the softmax is over ``logits / temperature``: a float, or a tensor that
            broadcasts to ``[..., S]`` (e.g. ``[..., 1]``, one per row). The scaled logits are
            never materialised.
        return_entropy: also return the entropy of the full-vocabulary distribution at each
            position, ``[..., S]``, from the same pass over the logits (differentiable).
        top_k, top_p: score under a sampler's filtered distribution (top-k, then top-p, of
            the logits over ``temperature``, as vLLM and NeMo-RL filter): the ids kept are
            those of at least the ``top_k``-th largest logit (ties kept), then of those the
            fewest most probable whose mass reaches ``top_p`` (tied ids kept or dropped
            together); the softmax is over the kept ids, and a target filtered out has
            log-prob ``-inf`` and no gradient. ``None`` and ``1.0`` filter nothing. Needs an
            even split in rank order (``vocab_start = rank * V_local``, NeMo-RL's layout),
            and not ``return_entropy``. Filtering needs whole rows: one all-to-all of the
            logits hands each rank ``1 / TP`` of the rows, whole, to filter (as NeMo-RL
            does), and one all-gather of ``[B·S / TP, 3 + K]`` statistics brings the rows'
            back (per chunk, with ``chunk_size``); backward communicates nothing.

    Returns:
        fp32 log-probs of ``target``'s shape, differentiable with respect to ``logits``
        (gradient in their dtype); with ``return_entropy``, ``(logprobs, entropy)``.

    A target that is not in ``[0, V)`` (and not ``ignore_index``) raises an error, detected on
    the device without a host sync (``torch._assert_async``).
    """
    _validate_logits(logits, chunk_size)
    vocab_start, ignore_index = _validate_target(logits, target, vocab_start, ignore_index)
    per_position = target.dim() == logits.dim() - 1
    ids = target.unsqueeze(-1) if per_position else target  # [..., S, K]
    filtering = _filter_options(top_k, top_p, logits, vocab_start, group, return_entropy)
    if filtering is not None:
        return _filtered_logprobs(
            logits,
            ids,
            *filtering,
            vocab_start=vocab_start,
            group=group,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
            temperature=temperature,
        ).view(target.shape)
    _, log_total, target_logit, entropy, _ = _stats(
        logits,
        ids,
        vocab_start=vocab_start,
        group=group,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        temperature=temperature,
        with_entropy=return_entropy,
    )
    return _logprob_outputs(
        target_logit, log_total, entropy, target, per_position, ignore_index, return_entropy
    )


def _logprob_outputs(
    target_logit: torch.Tensor,
    log_total: torch.Tensor,
    entropy: torch.Tensor,
    target: torch.Tensor,
    per_position: bool,
    ignore_index: int | None,
    return_entropy: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of ``target`` (``[..., S]``, ``per_position``, or ``[..., S, K]``; 0
    where ignored) and, with ``return_entropy``, the entropy ``[..., S]`` (0 where every id
    of a position is ignored), from the statistics ``target_logit`` ``[*, K]``, ``log_total``
    and ``entropy`` ``[*]`` over the same positions, in any leading shape."""
    logprobs = (target_logit - log_total.unsqueeze(-1)).view(target.shape)
    if ignore_index is not None:
        logprobs = torch.where(target == ignore_index, 0.0, logprobs)
    if not return_entropy:
        return logprobs
    entropy = entropy.view(target.shape if per_position else target.shape[:-1])
    if ignore_index is not None and (per_position or target.shape[-1]):
        # Positions whose every id is ignored (K = 0 ids ignore nothing).
        ignored = target == ignore_index
        entropy = torch.where(ignored if per_position else ignored.all(-1), 0.0, entropy)
    return logprobs, entropy


def _filtered_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    top_k: int,
    top_p: float,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    chunk_size: int | None,
    ignore_index: int | None,
    temperature: float | torch.Tensor,
) -> torch.Tensor:
    """Validated :func:`token_logprobs` with filtering, of ``target`` ``[..., S, K]``."""
    _, log_total, target_logit, _ = _ops.filtered_stats(
        _as_batch(logits, 2),
        _as_batch(target, 2),
        _temperature_rows(temperature, logits.shape[:-1], logits.device),
        vocab_start=vocab_start,
        group_name=_group_name(group),
        ignore_index=ignore_index,
        top_k=top_k,
        top_p=top_p,
        chunk_size=None if chunk_size is None else _as_int(chunk_size, "chunk_size"),
    )
    # A filtered-out id's log-prob is the constant -inf: no gradient flows from it.
    logprobs = torch.where(
        target_logit == -torch.inf, -torch.inf, target_logit - log_total.unsqueeze(-1)
    )
    if ignore_index is not None:
        logprobs = torch.where(_as_batch(target, 2) == ignore_index, 0.0, logprobs)
    return logprobs


def vocab_parallel_logsumexp(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Logsumexp over the full (sharded) vocabulary, fp32 ``[..., S]``, differentiable.

    Eager equivalent: ``torch.logsumexp(full_logits.float() / temperature, -1)``.
    """
    _validate_logits(logits, chunk_size)
    shift, log_total, _, _, _ = _stats(
        logits, None, group=group, chunk_size=chunk_size, temperature=temperature
    )
    return shift / _fp32_temperature(temperature) + log_total


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Entropy of the full-vocabulary distribution per position, fp32 ``[..., S]``, differentiable.

    Eager equivalent: ``torch.distributions.Categorical(logits=full_logits.float() / temperature).entropy()``.
    One all-gather of ``[..., S, 3]`` statistics; no collective in backward.
    """
    _validate_logits(logits, chunk_size)
    _, _, _, entropy, _ = _stats(
        logits, None, group=group, chunk_size=chunk_size, temperature=temperature, with_entropy=True
    )
    return entropy


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Cross-entropy of the target logits' distribution relative to the logits', over the full
    (sharded) vocabulary, fp32 ``[..., S]``: a distillation loss (the forward KL from the
    target's distribution up to that distribution's entropy, a constant for the student).

    Eager equivalent: ``-(torch.softmax(full_target.float() / temperature, -1) * torch.log_softmax(full_logits.float() / temperature, -1)).sum(-1)``.

    Args:
        logits: ``[..., S, V_local]``, the student's logits on this rank's vocabulary slice.
        target_logits: the same shape, sharded the same way: the teacher's logits (any
            floating dtype; both are read in fp32).
        group: the vocab-parallel group; ``None`` (or size 1): the vocabulary is not sharded.
        chunk_size: sequence positions per eager block (bounds the temporaries).
        temperature: both softmaxes are of ``logits / temperature``; a float or a tensor that
            broadcasts to ``[..., S]``, as in :func:`token_logprobs`.

    Differentiable with respect to both inputs (detach ``target_logits`` for a fixed
    teacher: no gradient is computed for it then). One all-gather of ``[..., S, 5]``
    statistics; the backward is one elementwise pass per input, with no collective. The
    result stays accurate for logits ×1000 (its two parts are non-negative sums); it is
    ``inf`` where the target puts mass on a ``-inf`` logit, and NaN for a NaN logit.
    """
    _validate_logits(logits, chunk_size)
    _validate_logits(target_logits, None, "target_logits")
    if target_logits.shape != logits.shape or target_logits.device != logits.device:
        raise ValueError(
            f"target_logits ({tuple(target_logits.shape)} on {target_logits.device}) must have "
            f"the logits' shape {tuple(logits.shape)} and device {logits.device}: the same "
            "positions and vocabulary shard"
        )
    rows_shape = logits.shape[:-1]
    *_, cross_entropy = _ops.cross_entropy_stats(
        _as_batch(logits, 2),
        _as_batch(target_logits, 2),
        _temperature_rows(temperature, rows_shape, logits.device),
        group_name=_group_name(group),
        chunk_size=None if chunk_size is None else _as_int(chunk_size, "chunk_size"),
    )
    return cross_entropy.view(rows_shape)


def _check_topk(k: int, vocab_start: int, width: int) -> None:
    """``k`` for a top-k over a shard of ``width`` entries from ``vocab_start``."""
    vocab_end = _as_int(vocab_start, "vocab_start", minimum=0) + width
    if vocab_end > _MAX_TOPK_VOCAB:
        raise ValueError(
            f"the top-k supports vocabularies of up to 2**24 ids (they travel as fp32), but "
            f"this shard ends at id {vocab_end}"
        )
    if _as_int(k, "k") not in range(1, width + 1):
        raise ValueError(
            f"k must be an int in [1, V_local = {width}] (this rank's vocabulary slice), "
            f"got {k!r}"
        )


def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens over the full (sharded) vocabulary and their log-probs.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1).topk(k)``.

    Returns ``(logprobs, ids)``, both ``[..., S, k]``: fp32 log-probs (differentiable with
    respect to ``logits``) and int64 global vocabulary ids, sorted by decreasing probability.
    Each rank finds its local top ``k`` in the statistics pass of :func:`token_logprobs`
    (the block maxima that select them also give the row max), and the one all-gather of
    statistics carries them, so that the global ones are picked after it. Beyond the
    plain pass, it keeps one temporary: the block maxima, ``[..., S, V_local / 16]`` (per
    chunk of ``chunk_size`` positions in eager). Requires ``k <= V_local`` on every rank:
    with uneven shards, ``k`` at most the smallest shard (a rank with fewer entries raises
    before the collective, which the others would then wait in).
    """
    _validate_logits(logits, chunk_size)
    _check_topk(k, vocab_start, logits.shape[-1])
    _, log_total, top_logits, _, ids = _stats(
        logits,
        None,
        vocab_start=vocab_start,
        group=group,
        chunk_size=chunk_size,
        temperature=temperature,
        topk=k,
    )
    return top_logits - log_total.unsqueeze(-1), ids


def vocab_parallel_log_softmax(
    logits: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This shard of the log-softmax over the full vocabulary, ``[..., S, V_local]``.

    Eager equivalent: ``torch.log_softmax(full_logits.float() / temperature, -1)[..., vocab_start:vocab_end].to(dtype)``.
    The result is ``dtype`` (default: the logits' dtype); ``temperature`` as in
    :func:`token_logprobs`. Unlike the token log-probs this materialises a full
    ``[..., S, V_local]`` tensor, and ``chunk_size`` bounds only the statistics pass: forward
    and backward each form fp32 temporaries of the output's size. Prefer
    :func:`token_logprobs` when only the targets' log-probs are needed. Its backward
    all-reduces one fp32 ``[..., S]`` gradient over ``group``: every rank's output depends
    on every shard.
    """
    _validate_logits(logits, chunk_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    shift, log_total, _, _, _ = _stats(
        logits.detach(), None, group=group, chunk_size=chunk_size, temperature=temperature
    )
    temperature = _fp32_temperature(temperature)
    per_row = isinstance(temperature, torch.Tensor)
    inverse_t = 1.0 / (temperature.unsqueeze(-1) if per_row else temperature)
    return _LogSoftmax.apply(
        logits, shift, log_total, inverse_t, _group_name(group), dtype or logits.dtype
    )


class _LogSoftmax(torch.autograd.Function):
    """``(logits − shift) / temperature − log_total`` with the gradient
    ``(G − softmax · sum(G)) / temperature`` formed in fp32, rounded once.

    The output is sharded but depends on every shard through ``log_total``, so ``sum(G)``
    runs over the full vocabulary: one fp32 ``[..., S]`` all-reduce over the group.
    """

    @staticmethod
    def forward(ctx, logits, shift, log_total, inverse_t, group_name, dtype):
        ctx.save_for_backward(logits, shift, log_total)
        ctx.inverse_t, ctx.group_name = inverse_t, group_name
        return _LogSoftmax.fp32(logits, shift, log_total, inverse_t).to(dtype)

    @staticmethod
    def fp32(logits, shift, log_total, inverse_t):
        return (logits.float() - shift.unsqueeze(-1)) * inverse_t - log_total.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, shift, log_total = ctx.saved_tensors
        grad = grad.float()
        grad_sum = grad.sum(-1)
        if ctx.group_name is not None:
            grad_sum = funcol.wait_tensor(funcol.all_reduce(grad_sum, "sum", ctx.group_name))
        softmax = torch.exp(_LogSoftmax.fp32(logits, shift, log_total, ctx.inverse_t))
        grad_logits = (grad - grad_sum.unsqueeze(-1) * softmax) * ctx.inverse_t
        return grad_logits.to(logits.dtype), None, None, None, None, None
