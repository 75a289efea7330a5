"""The cross-rank agreement check: before a call's first collective, every rank learns what
every other rank is about to do, and all raise the same error if they differ.

Off by default; ``COMPILED_LOGPROB_CHECK_RANKS=1`` in the environment, or
:func:`check_ranks`, turns it on. A checked call first runs itself on fake tensors (no data,
no communication) to find the argument error this rank would raise, then all-gathers over
each group of the call a fixed-size record of what must agree across ranks (the positions'
shapes, the options that shape the collectives) and that error, and raises on every rank
the same error, naming the ranks that differ. It is eager only: a compiled call is traced
once per shape, where a host-side exchange has no place (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from compiled_logprob import _comm
from compiled_logprob._torch_compat import FakeTensorMode

ENV = "COMPILED_LOGPROB_CHECK_RANKS"
# Bytes of one rank's record: what it describes is a few shapes and options.
RECORD_BYTES = 1024
_state = threading.local()
_enabled = os.environ.get(ENV, "").strip() not in ("", "0")

F = TypeVar("F", bound=Callable[..., Any])

# Arguments whose every dimension must agree, and those whose leading ones must (the last is
# a rank's vocabulary slice, which may differ); options that shape a call's collectives.
_IDS = ("target", "input_ids", "ids", "cu_seqlens_padded", "seq_index")
_SLICED = ("logits", "target_logits", "hidden", "teacher_hidden", "tensor")
_OPTIONS = (
    "k", "return_entropy", "next_token", "max_seqlen", "top_k", "top_p", "dim", "ignore_index",
    "sequence_parallel",
)
_GROUPS = ("group", "cp_group")


def check_ranks(enabled: bool = True) -> bool:
    """Turn the cross-rank agreement check on (or off) for the calls that follow, in every
    thread; returns whether it was on. ``COMPILED_LOGPROB_CHECK_RANKS=1`` turns it on at
    import. It costs one small all-gather per group of a call, and a fake run of the call."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def agreed(fn: F) -> F:
    """``fn`` (a public entry point), checked across ranks when the check is on."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        # Compiling is checked before the thread-local, which Dynamo need not trace.
        if not _enabled or torch.compiler.is_compiling() or getattr(_state, "busy", False):
            return fn(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        groups = _groups(arguments)
        if not groups:
            return fn(*args, **kwargs)
        with _busy():
            error = _dry_run(fn, args, kwargs)
            _agree(fn.__name__, arguments, groups, error)
        return fn(*args, **kwargs)

    return cast(F, checked)


@contextlib.contextmanager
def _busy() -> Iterator[None]:
    """Inside a checked call, nested public calls are not checked again."""
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = False


def _groups(arguments: dict[str, Any]) -> list[dist.ProcessGroup]:
    """The call's groups of more than one rank: its TP group first, then its CP group (a
    DTensor's mesh gives its own)."""
    groups = [arguments.get(name) for name in _GROUPS]
    logits = arguments.get("logits")
    mesh = getattr(logits, "device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names:
        groups = [mesh.get_group(axis) for axis in ("tp", "cp") if axis in mesh.mesh_dim_names]
    return [g for g in groups if isinstance(g, dist.ProcessGroup) and g.size() > 1]


def _dry_run(fn: Callable[..., Any], args: tuple, kwargs: dict) -> BaseException | None:
    """The error this rank's call would raise before touching any data, found on fake
    tensors: no device work, no communication."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fn(*args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:
        return error
    return None


def _describe(arguments: dict[str, Any]) -> dict[str, Any]:
    """What must agree across the ranks of a call, as JSON-ready values."""
    record: dict[str, Any] = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) and name in _IDS:
            record[name] = list(value.shape)
        elif isinstance(value, torch.Tensor) and name in _SLICED:
            record[name] = [*value.shape[:-1], "*"]
        elif name == "temperature":
            is_tensor = isinstance(value, torch.Tensor)
            record[name] = list(value.shape) if is_tensor else "float"
        elif name in _OPTIONS and (value is None or isinstance(value, (bool, int, float))):
            record[name] = value
        elif name == "logits_dtype":  # the dtype of the tiles that the all-to-all trades
            record[name] = str(value)
    filtering = record.get("top_k") is not None or record.get("top_p", 1.0) != 1.0
    if filtering:  # each chunk of a filtered call makes its own collectives
        record["chunk_size"] = arguments.get("chunk_size")
    return record


def _encode(record: dict[str, Any]) -> torch.Tensor:
    data = json.dumps(record, default=str).encode()
    if len(data) > RECORD_BYTES:  # keep the call and its verdict, which say the most
        verdict = record.get("verdict")
        if verdict is not None:
            verdict = {**verdict, "message": verdict["message"][: RECORD_BYTES // 2]}
        record = {"call": record.get("call"), "truncated": True, "verdict": verdict}
        data = json.dumps(record, default=str).encode()
    buffer = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _decode(buffer: torch.Tensor) -> dict[str, Any]:
    data = bytes(buffer.tolist()).rstrip(b"\0")
    return json.loads(data.decode())


def _agree(
    name: str,
    arguments: dict[str, Any],
    groups: list[dist.ProcessGroup],
    error: BaseException | None,
) -> None:
    """Exchange the records over each group in turn (a verdict reached in one group travels
    in the next), then raise the same error on every rank if any rank's differ or failed."""
    verdict: dict[str, Any] | None = None
    if error is not None:
        verdict = {"type": type(error).__name__, "message": f"rank {dist.get_rank()}: {error}"}
    for group in groups:
        record = {"call": name, **_describe(arguments), "verdict": verdict}
        records = [_decode(b) for b in _comm.all_gather_bytes(_encode(record), group)]
        ranks = dist.get_process_group_ranks(group)
        verdict = _verdict_of(records, ranks) or verdict
    if verdict is not None:
        kind = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(verdict["type"], ValueError)
        raise kind(f"compiled_logprob: the ranks' calls disagree: {verdict['message']}")


def _verdict_of(records: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any] | None:
    """The first failing rank's verdict, or where the ranks' records differ, or ``None``."""
    for record in records:
        if record.get("verdict") is not None:
            return cast(dict[str, Any], record["verdict"])
    first = records[0]
    for rank, record in zip(ranks[1:], records[1:]):
        for key in sorted(set(first) | set(record)):
            if first.get(key) != record.get(key):
                message = (
                    f"{key} differs: rank {rank}: {record.get(key)}, rank {ranks[0]}: "
                    f"{first.get(key)} (in {first.get('call')}); every rank must make the same call"
                )
                return {"type": "ValueError", "message": message}
    return None
