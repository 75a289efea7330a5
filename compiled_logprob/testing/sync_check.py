"""A dispatch mode that fails on any operation that would make the host wait for the device.

::

    with no_host_syncs():
        loss = token_logprobs(logits, target).sum()
        loss.backward()

raises ``AssertionError`` naming the op at the first ``.item()``, ``bool(tensor)``,
``nonzero``, boolean-mask indexing, ``unique``, device-to-host copy, … — on any device,
CPU included, so that CPU tests catch what would stall a GPU or break CUDA-graph capture.
``torch._assert_async`` is allowed: it checks on the device without waiting.

A dispatch mode sees an op once, at the top: the op's own kernel then runs with the mode
popped, so syncs *inside* it would be invisible. Two kinds of op are therefore re-run with
the mode pushed back: composite ops (whose decomposition is plain torch code) and the
custom ops of the ``transparent`` namespaces (``compiled_logprob`` by default), whose Python
kernel then has every aten op it calls checked too. Backward passes run by ``.backward()``
inside the context are checked as well (autograd runs them under the caller's modes).
Not seen: reads that bypass the dispatcher on CPU tensors (``tensor.tolist()``, printing);
on an accelerator they go through a device-to-host copy, which is caught.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["no_host_syncs"]

aten = torch.ops.aten

# Ops that always wait for the device: they return a host value or a data-dependent shape.
_ALWAYS_SYNC = {
    aten._local_scalar_dense: "reads a tensor's value on the host (.item(), bool(), int())",
    aten.item: "reads a tensor's value on the host",
    aten.is_nonzero: "reads a tensor's value on the host (bool(tensor), if tensor:)",
    aten.equal: "returns a host bool (torch.equal)",
    aten.allclose: "returns a host bool (torch.allclose)",
    aten.nonzero: "has a data-dependent output shape (nonzero, argwhere, where(cond))",
    aten.masked_select: "has a data-dependent output shape",
    aten._unique: "has a data-dependent output shape (unique)",
    aten._unique2: "has a data-dependent output shape (unique)",
    aten.unique_dim: "has a data-dependent output shape (unique)",
    aten.unique_consecutive: "has a data-dependent output shape (unique_consecutive)",
    aten.unique_dim_consecutive: "has a data-dependent output shape (unique_consecutive)",
    aten.bincount: "has a data-dependent output shape (its length is the maximum value + 1)",
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` would wait for the device, or ``None`` if it would not."""
    packet = func.overloadpacket
    if packet in _ALWAYS_SYNC:
        return _ALWAYS_SYNC[packet]
    if packet in _INDEX_OPS and any(_is_mask(index) for index in args[1]):
        return "indexes with a boolean mask, which has a data-dependent shape; use torch.where"
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        return "has a data-dependent output shape unless output_size= is given"
    if packet is aten._to_copy or packet is aten.copy_:
        if packet is aten.copy_:
            source, target = args[1].device, args[0].device
        else:
            source, target = args[0].device, kwargs.get("device")
        if source.type != "cpu" and target is not None and torch.device(target).type == "cpu":
            return f"copies from {source} to the host"
    return None


class _NoHostSyncMode(TorchDispatchMode):
    def __init__(self, transparent: frozenset[str]) -> None:
        super().__init__()
        self.transparent = transparent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise AssertionError(f"host sync: {func} {reason}")
        if func.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd):
            with self:
                return func.decompose(*args, **kwargs)
        if func.namespace in self.transparent:
            with self:
                return func._op_dk(DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        return func(*args, **kwargs)


def no_host_syncs(*, transparent: Iterable[str] = ("compiled_logprob",)) -> TorchDispatchMode:
    """A context manager that raises ``AssertionError`` naming the first host-syncing op.

    ``transparent``: namespaces of custom ops whose Python kernels are checked op by op
    (their kernels must be registered for all devices, as ``torch.library.custom_op`` does).
    """
    return _NoHostSyncMode(frozenset(transparent))
