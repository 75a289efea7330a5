"""The peers a user would pick instead of ``token_logprobs``, each called as its users call
it, on this rank's logits ``[B, S, V_local]`` and global targets ``[B, S]``, returning
log-probs ``[B, S]`` (``harness.make_step`` times them beside ours):

* ``torch_compiled``: ``torch.log_softmax(x.float(), -1).gather(...)`` under
  ``torch.compile`` (what a user writes first; whole vocabulary only);
* ``loss_parallel``, ``loss_parallel_compiled``: ``F.cross_entropy(reduction="none")`` of
  vocabulary-sharded DTensor logits under ``torch.distributed.tensor.parallel.loss_parallel``,
  eager and compiled (torch's own vocab-parallel path; its backward runs in the context too);
* ``megatron``: megatron-core's ``vocab_parallel_cross_entropy``, which overwrites fp32
  logits (softmax, then gradient) in place (the optional ``peers`` extra);
* ``liger``: Liger-Kernel's ``liger_cross_entropy(reduction="none")`` (Triton, so CUDA
  only; whole vocabulary), which writes the gradient into the logits in its forward;
* ``compiled_inplace``: ours compiled with ``inplace_backward`` in training (the logits
  consumed as Megatron consumes them).

The consuming methods (:data:`CONSUMING`) get their own copy of the logits. Each peer is
built once per (method, layout, mode) in ``compiled_cache``; :func:`unavailable` says why a
peer cannot run here (a missing package, a device, a layout).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_logprob import token_logprobs

METHODS = ("torch_compiled", "compiled_inplace", "loss_parallel", "loss_parallel_compiled", "megatron", "liger")
CONSUMING = ("compiled_inplace", "megatron", "liger")
# The package each optional peer imports (the ``peers`` extra, or ``perf/site`` on a GPU).
PACKAGES = {"megatron": "megatron.core", "liger": "liger_kernel"}
_MESH: dict = {}


def unavailable(method: str, tp: int, device: str) -> str | None:
    """Why ``method`` cannot run at this TP on this device, or ``None`` when it can."""
    package = PACKAGES.get(method)
    if package is not None and importlib.util.find_spec(package.split(".")[0]) is None:
        return f"{package} is not installed"
    if method in ("torch_compiled", "liger") and tp != 1:
        return "needs the whole vocabulary"
    if method == "liger" and not device.startswith("cuda"):
        return "Triton kernels: CUDA only"
    return None


def _world(device: str) -> int:
    """The ranks of this process's default group, made (of one rank) when there is none:
    DTensor and megatron-core need one even on a single process (NCCL for CUDA tensors)."""
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return dist.get_world_size()


def _mesh(tp: int, device: str):
    from torch.distributed.device_mesh import init_device_mesh

    assert _world(device) == tp, "the peers' layouts shard the vocabulary over every rank"
    kind = device.split(":")[0]
    if kind not in _MESH:
        _MESH[kind] = init_device_mesh(kind, (tp,), mesh_dim_names=("tp",))
    return _MESH[kind]


def _loss_parallel(mesh) -> Callable:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def logprobs(z, target):
        logits = DTensor.from_local(z, mesh, [Shard(-1)], run_check=False)
        ids = DTensor.from_local(target.flatten(), mesh, [Replicate()], run_check=False)
        # Under the loss_parallel context of peers.context: the backward needs it too.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids, reduction="none")
        return -loss.to_local().view(target.shape)

    return logprobs


def _megatron(tp: int, device: str) -> Callable:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    assert _world(device) == tp
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # A view of the leaf: a model's output, which megatron-core overwrites.
    return lambda z, t: -vocab_parallel_cross_entropy(z.view_as(z), t)


def _liger() -> Callable:
    from liger_kernel.transformers.functional import liger_cross_entropy

    def logprobs(z, target):
        # Liger takes [tokens, V]: a view of the leaf, whose storage its forward overwrites.
        loss = liger_cross_entropy(z.flatten(0, 1), target.flatten(), reduction="none")
        return -loss.view(target.shape)

    return logprobs


def _torch_log_softmax_gather(logits, target):
    return torch.log_softmax(logits.float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def peer(method: str, case, start: int, group, compiled_cache: dict, device: str = "cpu") -> Callable:
    """``fn(logits, target) -> log-probs`` of one of :data:`METHODS` on ``device``."""
    reason = unavailable(method, case.tp, device)
    if reason is not None:
        raise RuntimeError(f"peer {method!r} cannot run here: {reason}")
    key = (method, case.dtype, case.backward, case.tp, case.chunk, start, device)
    if key in compiled_cache:
        return compiled_cache[key]
    if method == "torch_compiled":
        fn = torch.compile(_torch_log_softmax_gather, fullgraph=True)
    elif method.startswith("loss_parallel"):
        fn = _loss_parallel(_mesh(case.tp, device))
        if method == "loss_parallel_compiled":
            fn = torch.compile(fn, fullgraph=True)
    elif method == "megatron":
        fn = _megatron(case.tp, device)
    elif method == "liger":
        fn = _liger()
    elif method == "compiled_inplace":
        ours = torch.compile(
            lambda z, t: token_logprobs(
                z, t, vocab_start=start, group=group, chunk_size=case.chunk,
                inplace_backward=case.backward,
            ),
            fullgraph=True,
        )

        def fn(z, t):
            return ours(z.view_as(z), t)  # a view of the leaf: a model's output, consumed
    else:
        raise ValueError(f"unknown peer {method!r}; expected one of {METHODS}")
    compiled_cache[key] = fn
    return fn


def context(method: str):
    """The context that ``method``'s forward and backward run in."""
    if method.startswith("loss_parallel"):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext
