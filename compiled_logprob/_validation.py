"""Argument checks and normalisation, once per public call: every public entry point
validates its arguments here, before any op runs, and passes the normalised values down.
Errors name the value and the fix."""

from __future__ import annotations

import numbers
import operator
from typing import NamedTuple, SupportsIndex, TypeGuard, cast

import torch
import torch.distributed as dist

from compiled_logprob import _comm
from compiled_logprob._math.kernels import assert_async


def as_batch(tensor: torch.Tensor, kept_dims: int) -> torch.Tensor:
    """Fold all leading dims but the last ``kept_dims`` into one batch dim (adding one if none):
    ``[..., S, V_local]`` -> ``[B, S, V_local]`` with ``kept_dims=2``."""
    if tensor.dim() == kept_dims:
        return tensor.unsqueeze(0)
    return tensor.flatten(0, -kept_dims - 1)


def as_int(value: object, name: str, *, minimum: int | None = None) -> int:
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
        value = operator.index(cast(SupportsIndex, value))  # its type has __index__
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """``logits`` must be a floating ``[..., S, V_local]`` tensor with a non-empty shard."""
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


def check_inplace_backward(logits: torch.Tensor, inplace_backward: object) -> None:
    """``inplace_backward``, checked: a bool, and only for logits that a model computed."""
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r:.80}")
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "inplace_backward=True needs logits that a model computed (a non-leaf tensor): a "
            "leaf's gradient goes to its own .grad buffer anyway, and its values would be lost; "
            "pass inplace_backward=False"
        )


def check_token_ids(ids: torch.Tensor, name: str) -> None:
    """``ids`` must be an int64/int32 tensor: gather and index_select take nothing else."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{name} must hold integer token ids (int64 or int32), got dtype {ids.dtype}; "
            f"pass {name}.long()"
        )


def check_target(logits: torch.Tensor, target: torch.Tensor, ignore_index: object) -> None:
    """Checks ``target`` ``[..., S]`` or ``[..., S, K]`` against ``logits`` ``[..., S, *]``
    (or hidden states), and that ``ignore_index`` fits its dtype."""
    check_token_ids(target, "target")
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
    check_ignore_index(ignore_index, target)


def check_ignore_index(ignore_index: object, ids: torch.Tensor) -> None:
    """``ignore_index`` (``None`` or an int) must fit the dtype of the ids it is compared to."""
    if ignore_index is not None:
        ignore_index = as_int(ignore_index, "ignore_index")
        info = torch.iinfo(ids.dtype)
        if not info.min <= ignore_index <= info.max:
            raise ValueError(
                f"ignore_index={ignore_index} does not fit the target's dtype {ids.dtype} "
                f"(it would wrap around and ignore another id): pass target.long()"
            )


# fp32 temperatures: the smallest normal one (below it 1 / T overflows), and the largest.
TEMPERATURE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def is_real(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a real number (an int, a float, numpy's scalars), not a bool: one
    that compares with floats as a float does."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_float_temperature(temperature: object, accepted: str) -> None:
    """A number ``temperature`` must be a normal finite fp32 one: the math divides by it in
    fp32, and its reciprocal must not overflow. ``accepted`` says what the caller takes.
    (Python compares a huge int with a float exactly: no OverflowError here.)"""
    if not is_real(temperature):
        raise TypeError(f"temperature must be {accepted}, got {temperature!r:.80}")
    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ValueError(
            f"temperature must be a finite fp32 number >= {low:.3g} (1 / temperature must "
            f"not overflow), got {temperature!r:.80}"
        )


def fp32_temperature(temperature: float | torch.Tensor) -> float | torch.Tensor:
    """A validated temperature as the ops see it: a float, or a tensor in fp32."""
    return temperature.float() if isinstance(temperature, torch.Tensor) else temperature


# Formed once: under torch.compile(dynamic=True) a float read at trace time is symbolic.
_TEMPERATURE_MESSAGE = (
    f"temperature must be a finite fp32 number >= {TEMPERATURE_RANGE[0]:.3g} everywhere"
)


def temperature_rows(
    temperature: float | torch.Tensor,
    rows_shape: torch.Size,
    device: torch.device,
    name: str = "logits",
) -> torch.Tensor | None:
    """``None`` for 1, else fp32 ``[B, S]`` (a broadcast view, nothing copied) for the
    positions ``rows_shape`` of the input ``name``."""
    low, high = TEMPERATURE_RANGE
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
        assert_async(((rows >= low) & (rows <= high)).all(), _TEMPERATURE_MESSAGE)
    else:
        check_float_temperature(temperature, "a float or a tensor")
        if temperature == 1:
            return None
        rows = torch.full((), float(temperature), device=device).expand(rows_shape)
    return as_batch(rows, 1)


class Options(NamedTuple):
    """A public call's options, validated once and passed down as the ops take them."""

    vocab_start: int = 0
    group_name: str | None = None
    chunk_size: int | None = None
    ignore_index: int | None = None


class Head(NamedTuple):
    """The options of a hidden-state call that the logits path does not have, validated."""

    sequence_parallel: bool  # the hidden states are this rank's S / TP positions
    logits_dtype: torch.dtype  # of each logits tile: the inputs' dtype, or fp32


def head_options(
    hidden: torch.Tensor, sequence_parallel: object, logits_dtype: object
) -> Head:
    """The validated :class:`Head` options of a call on ``hidden``."""
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r:.80}")
    if logits_dtype is None:
        logits_dtype = hidden.dtype
    if logits_dtype not in (hidden.dtype, torch.float32):
        raise ValueError(
            f"logits_dtype must be None (the inputs' dtype, {hidden.dtype}) or torch.float32 "
            f"(an fp32 LM head's logits), got {logits_dtype!r}"
        )
    return Head(sequence_parallel, cast(torch.dtype, logits_dtype))


def filter_options(
    top_k: object,
    top_p: object,
    width: int,
    options: Options,
    group: dist.ProcessGroup | None,
    return_entropy: bool,
) -> tuple[int, float] | None:
    """Validated ``(top_k, top_p)`` (``top_k`` capped at the full vocabulary), or ``None``
    when they filter nothing; ``width``: this rank's vocabulary slice ``V_local``."""
    if top_k is not None:
        top_k = as_int(top_k, "top_k", minimum=1)
    if not is_real(top_p):
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
    vocab_start = options.vocab_start
    size, rank = _comm.size_rank(group)
    if vocab_start != rank * width:
        raise ValueError(
            f"top_k/top_p need the vocabulary split evenly in rank order (rank r holds ids "
            f"[r * V_local, (r + 1) * V_local), as NeMo-RL's layout), but rank {rank} of the "
            f"group holds [{vocab_start}, {vocab_start + width}): split the vocabulary evenly "
            "(pad it to a multiple of the TP size with -inf logits)"
        )
    return min(top_k or size * width, size * width), float(top_p)


# Top-k ids travel beside the candidates' values as fp32, exact up to 2**24.
MAX_TOPK_VOCAB = 1 << 24


def check_topk(k: object, vocab_start: int, width: int) -> int:
    """``k`` as an int, for a top-k over a shard of ``width`` entries from ``vocab_start``."""
    vocab_end = vocab_start + width
    if vocab_end > MAX_TOPK_VOCAB:
        raise ValueError(
            f"the top-k supports vocabularies of up to 2**24 ids (they travel as fp32), but "
            f"this shard ends at id {vocab_end}"
        )
    if (count := as_int(k, "k")) not in range(1, width + 1):
        raise ValueError(
            f"k must be an int in [1, V_local = {width}] (this rank's vocabulary slice), "
            f"got {k!r}"
        )
    return count


def options(
    *,
    vocab_start: object = 0,
    group: dist.ProcessGroup | None = None,
    chunk_size: object = None,
    ignore_index: object = None,
) -> Options:
    """The validated :class:`Options` of a public call."""
    return Options(
        vocab_start=as_int(vocab_start, "vocab_start", minimum=0),
        group_name=_comm.group_name(group),
        chunk_size=None if chunk_size is None else as_int(chunk_size, "chunk_size", minimum=1),
        ignore_index=None if ignore_index is None else as_int(ignore_index, "ignore_index"),
    )
