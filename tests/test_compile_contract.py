"""The compile contract of every public entry point and every custom op.

* ``torch.library.opcheck`` on every op of the ``compiled_logprob`` namespace, with the
  cases of ``helpers.OPCHECK_CASES`` (an op registered without cases there fails the suite);
* ``torch.compile(fullgraph=True)`` forward and backward equal eager, unsharded and on TP=2
  gloo, on ``aot_eager`` and Inductor;
* four sequence lengths compile at most twice (one static, one dynamic graph), forward and
  backward;
* one all-gather per call in the forward graph, nothing but the documented collectives in the
  backward graph;
* no host sync on any eager path, forward and backward
  (:func:`compiled_logprob.testing.sync_check.no_host_syncs`, itself tested first).

Compiles are the expensive part: every entry point is traced into *one* compiled function,
compiled once per backend and shared by the tests through module-scoped fixtures.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import OPCHECK_CASES, custom_op
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import (
    default_partition,
    min_cut_rematerialization_partition,
)
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.distributed.fake_pg import FakeStore

import compiled_logprob as cl
from compiled_logprob import nemo_compat
from compiled_logprob._torch_compat import all_gather_single
from compiled_logprob.testing.reference import vocab_bounds
from compiled_logprob.testing.sync_check import no_host_syncs

BATCH, VOCAB, CHUNK, IGNORE = 2, 11, 4, 3
SEQ_LENS = (5, 9, 13, 17)  # S=1 would specialise; 4 lengths must compile at most twice
TP = 2


# --------------------------------------------------------------------------------------
# Entry points, all as f(logits, target, vocab_start, vocab_end, group).


def _token_logprobs(logits, target, start, end, group):
    return cl.token_logprobs(logits, target, vocab_start=start, group=group)


def _token_logprobs_ignore(logits, target, start, end, group):
    return cl.token_logprobs(logits, target, vocab_start=start, group=group, ignore_index=IGNORE)


def _token_logprobs_chunked_ignore(logits, target, start, end, group):
    return cl.token_logprobs(
        logits, target, vocab_start=start, group=group, chunk_size=CHUNK, ignore_index=IGNORE
    )


def _logsumexp(logits, target, start, end, group):
    return cl.vocab_parallel_logsumexp(logits, group=group)


def _logsumexp_chunked(logits, target, start, end, group):
    return cl.vocab_parallel_logsumexp(logits, group=group, chunk_size=CHUNK)


def _log_softmax_temperature(logits, target, start, end, group):
    # The plain path is _compute_distributed_log_softmax's.
    return cl.vocab_parallel_log_softmax(logits, group=group, temperature=0.7)


def _token_logprobs_temperature_entropy(logits, target, start, end, group):
    logprobs, entropy = cl.token_logprobs(
        logits,
        target,
        vocab_start=start,
        group=group,
        ignore_index=IGNORE,
        temperature=0.7,
        return_entropy=True,
    )
    return torch.stack([logprobs, entropy])


def _token_logprobs_k_ids(logits, target, start, end, group):
    # K = 3: the target (ignored at some positions), another id, and the target repeated.
    valid = target.clamp(min=0)
    ids = torch.stack([target, (valid * 7 + 3) % VOCAB, valid], dim=-1)
    return cl.token_logprobs(logits, ids, vocab_start=start, group=group, ignore_index=IGNORE)


def _entropy_chunked_row_temperature(logits, target, start, end, group):
    temperature = torch.linspace(0.5, 2.0, logits.shape[0]).unsqueeze(-1)
    return cl.vocab_parallel_entropy(logits, group=group, chunk_size=CHUNK, temperature=temperature)


def _topk(logits, target, start, end, group):
    logprobs, _ = cl.vocab_parallel_topk(logits, 3, vocab_start=start, group=group)
    return logprobs


def _distributed_logprob(logits, target, start, end, group):
    return cl.DistributedLogprob.apply(logits, target, start, end, group)


def _chunked_distributed_logprob(logits, target, start, end, group):
    return cl.ChunkedDistributedLogprob.apply(logits, target, start, end, CHUNK, group)


def _compute_distributed_log_softmax(logits, target, start, end, group):
    return cl._compute_distributed_log_softmax(logits, group)


def _compute_distributed_log_softmax_with_grad(logits, target, start, end, group):
    return cl._compute_distributed_log_softmax_with_grad(logits, group)


def _chunked_distributed_gather_logprob(logits, target, start, end, group):
    ids = torch.stack([target, (target * 5 + 1) % VOCAB], dim=-1)
    return cl.ChunkedDistributedGatherLogprob.apply(logits, ids, start, end, CHUNK, group)


def _chunked_distributed_entropy(logits, target, start, end, group):
    return cl.ChunkedDistributedEntropy.apply(logits, CHUNK, group)


def _distributed_vocab_topk(logits, target, start, end, group):
    # Not differentiable: no backward graph, no gradient.
    values, ids = cl.distributed_vocab_topk(
        logits, 3, group, vocab_start_index=start, vocab_end_index=end
    )
    return torch.cat([values, ids.float()], dim=-1)


def _gather_logits_at_global_indices(logits, target, start, end, group):
    ids = torch.stack([target, (target * 5 + 1) % VOCAB], dim=-1)
    return cl.gather_logits_at_global_indices(
        logits, ids, group, vocab_start_index=start, vocab_end_index=end
    )


def _even_shard(logits, group):
    """``(logits, vocab_start)`` of this shard padded with -inf to ``ceil(V / TP)`` ids: what
    filtering needs, the ids of rank r at ``[r · width, (r + 1) · width)`` (``vocab_bounds``
    gives the first ranks the extra ids, so only the last shards grow)."""
    size, rank = (1, 0) if group is None else (group.size(), group.rank())
    width = -(-VOCAB // size)
    padded = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))
    return padded, rank * width


def _token_logprobs_top_k_top_p(logits, target, start, end, group):
    logits, start = _even_shard(logits, group)
    return cl.token_logprobs(
        logits,
        target,
        vocab_start=start,
        group=group,
        ignore_index=IGNORE,
        temperature=0.7,
        top_k=3,
        top_p=0.9,
    )


def _chunked_distributed_logprob_with_sampling(logits, target, start, end, group):
    logits, _ = _even_shard(logits, group)
    return cl.ChunkedDistributedLogprobWithSampling.apply(logits, target, group, -1, 0.8, CHUNK)


def _cross_entropy(logits, target, start, end, group):
    # Target logits from the same leaf: its gradient holds both inputs' parts.
    teacher = 0.5 * logits + 1.0
    return cl.vocab_parallel_cross_entropy(logits, teacher, group=group, temperature=0.7)


def _distributed_cross_entropy(logits, target, start, end, group):
    return cl.DistributedCrossEntropy.apply(logits, logits.detach().flip(1), group)


def _get_distillation_topk_logprobs_from_logits(logits, target, start, end, group):
    logits, _ = _even_shard(logits, group)
    ids = torch.stack([target.clamp(min=0), (target.clamp(min=0) * 5 + 1) % VOCAB], dim=-1)
    student, _, neg_entropy = cl.get_distillation_topk_logprobs_from_logits(
        logits, ids.float(), ids, True, True, 0 if group is None else group.rank(), group
    )
    return torch.cat([student, neg_entropy.unsqueeze(-1)], dim=-1)


def _vocab_parallel_gather_columns(logits, target, start, end, group):
    logits, _ = _even_shard(logits, group)
    return cl.vocab_parallel_gather_columns(logits, torch.tensor([0, 7, VOCAB - 1]), tp_group=group)


def _vocab_parallel_argmax(logits, target, start, end, group):
    # Not differentiable: no backward graph, no gradient.
    logits, _ = _even_shard(logits, group)
    return cl.vocab_parallel_argmax(logits, tp_group=group).float()


def _group_all_reduce_sum_with_grad(logits, target, start, end, group):
    # A per-row sum: the same shape on every rank, whatever its shard's width.
    return cl.group_all_reduce_sum_with_grad(logits.sum(-1), group)


def _cp_shift_next(logits, target, start, end, group):
    # Any group works as the CP group of contiguous shards of one shape.
    return cl.cp_shift_next(logits.sum(-1, keepdim=True), group, fill=0.0)


def _vocab_parallel_topk_logits(logits, target, start, end, group):
    values, ids = cl.vocab_parallel_topk_logits(logits, 3, vocab_start=start, group=group)
    return torch.cat([values, ids.float()], dim=-1)


def _vocab_parallel_logits_at(logits, target, start, end, group):
    ids = torch.stack([target, (target * 5 + 1) % VOCAB], dim=-1)
    return cl.vocab_parallel_logits_at(logits, ids, vocab_start=start, group=group)


def _vocab_parallel_full_log_softmax(logits, target, start, end, group):
    # The gather takes shards of one width: the first VOCAB // TP ids of each.
    size = 1 if group is None else group.size()
    return nemo_compat.vocab_parallel_full_log_softmax(
        logits[..., : VOCAB // size], 0.9, tp_group=group
    )


ENTRY_POINTS = {
    fn.__name__.lstrip("_"): fn
    for fn in (
        _token_logprobs,
        _token_logprobs_ignore,
        _token_logprobs_chunked_ignore,
        _logsumexp,
        _logsumexp_chunked,
        _log_softmax_temperature,
        _token_logprobs_temperature_entropy,
        _token_logprobs_k_ids,
        _entropy_chunked_row_temperature,
        _topk,
        _distributed_logprob,
        _chunked_distributed_logprob,
        _compute_distributed_log_softmax,
        _compute_distributed_log_softmax_with_grad,
        _chunked_distributed_gather_logprob,
        _chunked_distributed_entropy,
        _distributed_vocab_topk,
        _gather_logits_at_global_indices,
        _token_logprobs_top_k_top_p,
        _chunked_distributed_logprob_with_sampling,
        _cross_entropy,
        _distributed_cross_entropy,
        _get_distillation_topk_logprobs_from_logits,
        _vocab_parallel_gather_columns,
        _vocab_parallel_argmax,
        _group_all_reduce_sum_with_grad,
        _cp_shift_next,
        _vocab_parallel_topk_logits,
        _vocab_parallel_logits_at,
        _vocab_parallel_full_log_softmax,
    )
}
# The raw logits at given ids sum the shards' in one all-reduce (its backward is each
# shard's own: no collective), not the statistics' all-gather. Filtering trades the logits
# for whole rows (all-to-all) and gathers the rows' statistics back.
FILTERED = {
    "_c10d_functional::all_to_all_single": 1,
    "_c10d_functional::all_gather_into_tensor": 1,
}
# The statistics: an all-gather of per-row statistics, then an all-reduce of exact tile sums.
STATS = {"_c10d_functional::all_gather_into_tensor": 1, "_c10d_functional::all_reduce": 1}
FORWARD_COLLECTIVES = {
    "gather_logits_at_global_indices": {"_c10d_functional::all_reduce": 1},
    "vocab_parallel_gather_columns": {"_c10d_functional::all_reduce": 1},
    "group_all_reduce_sum_with_grad": {"_c10d_functional::all_reduce": 1},
    "vocab_parallel_logits_at": {"_c10d_functional::all_reduce": 1},
    "vocab_parallel_full_log_softmax": {**STATS, "_c10d_functional::all_gather_into_tensor": 2},
    # One all-gather without the statistics: the distillation cross-entropy's, the top-k
    # candidates', a CP shift's.
    **dict.fromkeys(
        [
            "cp_shift_next",
            "cross_entropy",
            "distributed_cross_entropy",
            "distributed_vocab_topk",
            "vocab_parallel_argmax",
            "vocab_parallel_topk_logits",
        ],
        {"_c10d_functional::all_gather_into_tensor": 1},
    ),
    "token_logprobs_top_k_top_p": FILTERED,
    "chunked_distributed_logprob_with_sampling": FILTERED,
}
# A sharded [B, S, V_local] output depends on every shard: its backward sums over the group.
SHARDED_OUTPUT = {
    "log_softmax_temperature",
    "compute_distributed_log_softmax",
    "compute_distributed_log_softmax_with_grad",
    "vocab_parallel_full_log_softmax",
}


def all_entry_points(logits: dict, target, start, end, group) -> dict:
    """Every entry point on its own copy of the logits: one graph holds them all."""
    return {name: fn(logits[name], target, start, end, group) for name, fn in ENTRY_POINTS.items()}


def make_inputs(seq_len: int, start: int, end: int):
    """This shard's logits (one leaf per entry point) and global targets, the same on every rank;
    every third target is ``IGNORE``."""
    gen = torch.Generator().manual_seed(seq_len)
    full = 3 * torch.randn(BATCH, seq_len, VOCAB, generator=gen)
    target = torch.randint(0, VOCAB, (BATCH, seq_len), generator=gen)
    target[:, ::3] = IGNORE
    shard = full[..., start:end]
    return {name: shard.clone().requires_grad_() for name in ENTRY_POINTS}, target


def forward_backward(fn, logits: dict, target, start, end, group) -> dict:
    """``{name: (output, grad of the logits)}`` for a fixed random cotangent per output."""
    outputs = fn(logits, target, start, end, group)
    gen = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(out.shape, generator=gen) for out in outputs.values()]
    loss = sum((out.float() * dout).sum() for out, dout in zip(outputs.values(), cotangents))
    loss.backward()
    return {name: (out.detach(), logits[name].grad) for name, out in outputs.items()}


# Compiled and eager sum in different orders, so they agree to a few fp32 ulps of the
# largest intermediate. That is O(1) for everything but the entropy, whose gradient
# p·(1 + z − E[z]) inherits E[z]'s rounding, a few ulps of |z| (up to ~3·4.5/0.7 ≈ 20 here).
ATOL = {
    "token_logprobs_temperature_entropy": 8 * torch.finfo(torch.float32).eps * 20,
    "chunked_distributed_entropy": 8 * torch.finfo(torch.float32).eps * 20,
    # Σ p · (shift − x) / T: ulps of |z| too, as the entropy's E[z].
    "cross_entropy": 8 * torch.finfo(torch.float32).eps * 20,
    "distributed_cross_entropy": 8 * torch.finfo(torch.float32).eps * 20,
    "get_distillation_topk_logprobs_from_logits": 8 * torch.finfo(torch.float32).eps * 20,
}


def assert_results_close(actual: dict, expected: dict, label: str) -> None:
    for name, pair in expected.items():
        atol = max(1e-5, ATOL.get(name, 0.0))
        for kind, got, wanted in zip(("forward", "backward"), actual[name], pair):
            torch.testing.assert_close(
                got, wanted, rtol=1e-5, atol=atol, msg=lambda m: f"{label} {name} {kind}: {m}"
            )


# --------------------------------------------------------------------------------------
# Backends that record what they compile.


class RecordingBackend:
    """A ``torch.compile`` backend that keeps every forward and backward graph it compiles.

    ``"inductor"`` records the graphs Inductor lowers (after its decompositions and
    partitioning); ``"aot_eager"`` records AOT Autograd's graphs and runs them as they are,
    with ``as_inductor`` decomposed with Inductor's table and partitioned by its min-cut
    partitioner (the default partitioner of torch 2.12 recomputes a forward collective in
    backward, where Inductor's saves its output).
    """

    def __init__(self, backend: str, *, as_inductor: bool = False) -> None:
        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        if backend == "inductor":
            self._compile = partial(compile_fx, inner_compile=self._inductor_inner)
        else:
            self._compile = aot_autograd(
                fw_compiler=self._recorder("forward"),
                bw_compiler=self._recorder("backward"),
                decompositions=select_decomp_table() if as_inductor else None,
                partition_fn=(
                    min_cut_rematerialization_partition if as_inductor else default_partition
                ),
            )

    def _inductor_inner(self, gm, inputs, **kwargs):
        self.graphs["backward" if kwargs.get("is_backward") else "forward"].append(gm)
        return compile_fx_inner(gm, inputs, **kwargs)

    def _recorder(self, kind: str):
        def compiler(gm, inputs):
            self.graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    def __call__(self, gm, inputs):
        return self._compile(gm, inputs)

    def ops(self, kind: str, namespace: str) -> dict[str, int]:
        """``{op name: count}`` of the ``namespace`` ops in the recorded ``kind`` graphs."""
        return dict(
            Counter(
                node.target.name()
                for gm in self.graphs[kind]
                for node in gm.graph.nodes
                if isinstance(node.target, torch._ops.OpOverload)
                and node.target.namespace == namespace
            )
        )


def compile_recording(fn, backend: str, **options) -> tuple:
    recorder = RecordingBackend(backend, **options)
    return torch.compile(fn, backend=recorder, fullgraph=True), recorder


# --------------------------------------------------------------------------------------
# The sync checker itself.


@torch.library.custom_op("compiled_logprob_sync_check_test::hidden_item", mutates_args=())
def _hidden_item(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


_hidden_item.register_fake(lambda x: torch.empty_like(x))


def _item_in_backward(ctx, grad):
    return grad * grad.sum().item()


@torch.library.custom_op("compiled_logprob_sync_check_test::identity", mutates_args=())
def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_identity.register_fake(lambda x: torch.empty_like(x))
_identity.register_autograd(_item_in_backward)

_TEST_NAMESPACES = ("compiled_logprob", "compiled_logprob_sync_check_test")

_ITEM = r"aten\.(item|_local_scalar_dense)"  # item is composite: which one shows depends on the key
_X = torch.linspace(-1, 1, 6).view(2, 3)
_MASK = _X > 0
SYNCING = {
    "item": (lambda: _X.sum().item(), _ITEM),
    "bool": (lambda: bool(_X.sum() > 0), _ITEM),
    "nonzero": (lambda: _X.nonzero(), "aten.nonzero"),
    "argwhere": (lambda: torch.argwhere(_X), "aten.nonzero"),
    "where_cond": (lambda: torch.where(_MASK), "aten.nonzero"),
    "mask_index": (lambda: _X[_MASK], "aten.index.Tensor"),
    "mask_index_put": (lambda: _X.clone().__setitem__(_MASK, 0.0), "aten.index_put_"),
    "masked_select": (lambda: _X.masked_select(_MASK), "aten.masked_select"),
    "unique": (lambda: torch.unique(_X), "aten._unique2"),
    "unique_consecutive": (lambda: torch.unique_consecutive(_X), "aten.unique_consecutive"),
    "equal": (lambda: torch.equal(_X, _X), "aten.equal"),
    "allclose": (lambda: torch.allclose(_X, _X), "aten.allclose"),
    "repeat_interleave": (
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "aten.repeat_interleave",
    ),
    "device_to_host": (lambda: torch.empty(3, device="meta").cpu(), "aten._to_copy"),
    "custom_op_kernel": (lambda: _hidden_item(_X), _ITEM),
}
SYNC_FREE = {
    "assert_async": lambda: torch._assert_async((_X > -2).all(), "unreachable"),
    "where": lambda: torch.where(_MASK, _X, 0.0),
    "int_index": lambda: _X[:, torch.tensor([0, 2])],
    "nonzero_static": lambda: torch.nonzero_static(_X, size=3),
    "repeat_interleave_sized": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
}


@pytest.mark.parametrize("case", sorted(SYNCING))
def test_sync_check_names_the_syncing_op(case):
    fn, op_name = SYNCING[case]
    with pytest.raises(AssertionError, match=rf"host sync: {op_name}"):
        with no_host_syncs(transparent=_TEST_NAMESPACES):
            fn()


@pytest.mark.parametrize("case", sorted(SYNC_FREE))
def test_sync_check_allows_device_side_ops(case):
    with no_host_syncs():
        SYNC_FREE[case]()


def test_sync_check_sees_inside_custom_ops_only_when_transparent():
    # A dispatch mode is popped while an op runs: without re-entering, the kernel is opaque.
    with no_host_syncs(transparent=()):
        _hidden_item(_X)
    with pytest.raises(AssertionError, match=_ITEM):
        with no_host_syncs(transparent=_TEST_NAMESPACES):
            _hidden_item(_X)


def test_sync_check_covers_backward():
    x = _X.clone().requires_grad_()
    y = _identity(x).sum()
    with pytest.raises(AssertionError, match=_ITEM):
        with no_host_syncs(transparent=_TEST_NAMESPACES):
            y.backward()


def _functional_collectives_under_sync_check() -> None:
    group_name = dist.group.WORLD.group_name
    rank = dist.get_rank()
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    # torch 2.12 names the reduce-scatter as it did the all-gather (see _torch_compat).
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    with no_host_syncs():
        gathered = all_gather_single(x.detach(), 0, group_name)
        reduced = funcol.wait_tensor(funcol.all_reduce(x.detach(), "sum", group_name))
        scattered = reduce_scatter(x.detach(), "sum", 0, group_name)
        swapped = funcol.all_to_all_single(x.detach(), None, None, group_name)
        all_gather_single(x, 0, group_name).sum().backward()
        results = [t.clone() for t in (gathered, reduced, scattered, swapped, x.grad)]
    ones = torch.ones(2, 3)
    expected = [
        torch.cat([ones, 2 * ones]),  # all-gather
        3 * ones,  # all-reduce
        3 * ones[:1],  # reduce-scatter
        torch.stack([ones[0], 2 * ones[0]]),  # all-to-all
        2 * ones,  # all-gather's backward: its output summed over both ranks' losses
    ]
    for actual, wanted in zip(results, expected):
        torch.testing.assert_close(actual, wanted)


def test_sync_check_passes_functional_collectives_on_gloo(gloo_pool):
    gloo_pool(TP).run(_functional_collectives_under_sync_check)


# --------------------------------------------------------------------------------------
# opcheck on every custom op.


@pytest.fixture
def fake_group_name():
    """The name of a 2-rank fake process group (collectives run, values meaningless)."""
    assert not dist.is_initialized(), "a test left torch.distributed initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _registered_ops(namespace: str) -> set[str]:
    """The ops of ``namespace`` in the dispatcher's registry, every package module imported."""
    for module in pkgutil.walk_packages(cl.__path__, "compiled_logprob."):
        importlib.import_module(module.name)
    names = torch._C._dispatch_get_all_op_names()
    return {name for name in names if name.startswith(namespace + "::")}


def test_every_custom_op_has_opcheck_cases():
    """The ops with opcheck cases (``helpers.OPCHECK_CASES``, all run by :func:`test_opcheck`)
    are exactly the ops the package registers."""
    registered = _registered_ops("compiled_logprob")
    missing = registered - set(OPCHECK_CASES)
    assert not missing, f"ops without opcheck cases (add to helpers.OPCHECK_CASES): {sorted(missing)}"
    stale = set(OPCHECK_CASES) - registered
    assert not stale, f"helpers.OPCHECK_CASES names ops the package does not register: {sorted(stale)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op_name", sorted(OPCHECK_CASES))
def test_opcheck(op_name, dtype, fake_group_name):
    for args, kwargs in OPCHECK_CASES[op_name](dtype, fake_group_name):
        torch.library.opcheck(custom_op(op_name), args, kwargs)


# --------------------------------------------------------------------------------------
# fullgraph compile equals eager; no recompiles across sequence lengths.


@pytest.fixture(scope="module", params=["aot_eager", "inductor"])
def compiled_runs(request):
    """Every entry point, compiled as one function and run at every length in ``SEQ_LENS``:
    ``(recorder, {seq_len: (compiled results, eager results)})``."""
    torch._dynamo.reset()
    compiled, recorder = compile_recording(all_entry_points, request.param)
    runs = {}
    # A cache hit would skip the compile that the recorder counts.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        for seq_len in SEQ_LENS:
            results = [
                forward_backward(fn, *make_inputs(seq_len, 0, VOCAB), 0, VOCAB, None)
                for fn in (compiled, all_entry_points)
            ]
            runs[seq_len] = results
    yield recorder, runs
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_fullgraph_matches_eager(compiled_runs, name):
    _, runs = compiled_runs
    for seq_len, (compiled, eager) in runs.items():
        assert_results_close({name: compiled[name]}, {name: eager[name]}, f"S={seq_len}")


def test_at_most_two_compiles_for_four_lengths(compiled_runs):
    recorder, runs = compiled_runs
    compiles = {kind: len(graphs) for kind, graphs in recorder.graphs.items()}
    assert all(1 <= n <= 2 for n in compiles.values()), f"{compiles} for lengths {sorted(runs)}"


def _tp_fullgraph_matches_eager() -> None:
    torch._dynamo.reset()
    group = dist.group.WORLD
    start, end = vocab_bounds(VOCAB, TP, dist.get_rank())
    compiled = torch.compile(all_entry_points, backend="inductor", fullgraph=True)
    results = [
        forward_backward(fn, *make_inputs(SEQ_LENS[1], start, end), start, end, group)
        for fn in (compiled, all_entry_points)
    ]
    assert_results_close(*results, f"rank {dist.get_rank()}")
    torch._dynamo.reset()


def test_fullgraph_matches_eager_tp2(gloo_pool):
    gloo_pool(TP).run(_tp_fullgraph_matches_eager)


# --------------------------------------------------------------------------------------
# Collectives in the compiled graphs.


def _graph_ops_per_entry_point() -> dict:
    group = dist.group.WORLD
    start, end = vocab_bounds(VOCAB, TP, dist.get_rank())
    found = {}
    for name, fn in ENTRY_POINTS.items():
        torch._dynamo.reset()
        compiled, recorder = compile_recording(fn, "aot_eager", as_inductor=True)
        logits, target = make_inputs(SEQ_LENS[0], start, end)
        out = compiled(logits[name], target, start, end, group)
        if out.requires_grad:
            out.sum().backward()
        found[name] = {}
        for kind in ("forward", "backward"):
            ops = recorder.ops(kind, "_c10d_functional") | recorder.ops(kind, "compiled_logprob")
            ops.pop("_c10d_functional::wait_tensor", None)  # waits are not collectives
            # Per-row exp and log stay opaque by design: the same bits at any shape.
            ops.pop("compiled_logprob::pointwise", None)
            found[name][kind] = ops
    torch._dynamo.reset()
    return found


@pytest.fixture(scope="module")
def tp_graph_ops(gloo_pool):
    """``{entry point: {"forward"|"backward": {op: count}}}``: the collectives and custom ops
    of rank 0's graphs, decomposed as Inductor decomposes them, at TP=2."""
    return gloo_pool(TP).run(_graph_ops_per_entry_point)[0]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_collectives_per_call(tp_graph_ops, name):
    # The op is decomposed away (chunked or not); top-k candidates travel with the statistics.
    expected_forward = FORWARD_COLLECTIVES.get(name, STATS)
    expected_backward = {"_c10d_functional::all_reduce": 1} if name in SHARDED_OUTPUT else {}
    assert tp_graph_ops[name] == {"forward": expected_forward, "backward": expected_backward}


# --------------------------------------------------------------------------------------
# No host syncs on any eager path.


def test_no_host_syncs_unsharded():
    logits, target = make_inputs(SEQ_LENS[2], 0, VOCAB)
    with no_host_syncs():
        forward_backward(all_entry_points, logits, target, 0, VOCAB, None)


def _no_host_syncs_tp() -> None:
    start, end = vocab_bounds(VOCAB, TP, dist.get_rank())
    logits, target = make_inputs(SEQ_LENS[2], start, end)
    with no_host_syncs():
        forward_backward(all_entry_points, logits, target, start, end, dist.group.WORLD)


def test_no_host_syncs_tp2(gloo_pool):
    gloo_pool(TP).run(_no_host_syncs_tp)


# --------------------------------------------------------------------------------------
# No vocabulary-sized temporaries in the compiled code.

WIDE_VOCAB = 4096  # wide enough for every sliced reduction


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("return_entropy", [False, True], ids=["logprobs", "entropy"])
def test_compiled_buffers_stay_per_row(return_entropy, backward, dtype):
    """Inductor's code for the log-probs (with a temperature, and the entropy) allocates
    per-row buffers only, besides the gradient: no fp32 copy of the logits, and no
    sliced-reduction tree stored as a ``[B, S, V / slices]`` buffer (as Inductor does with a
    tree past its CPU op-count limit: ``_math.kernels.PAIR_SLICES``), whose pages fault in on every
    call."""
    logits = (3 * torch.randn(BATCH, 16, WIDE_VOCAB)).to(dtype).requires_grad_(backward)
    target = torch.randint(0, WIDE_VOCAB, (BATCH, 16))
    for x in (logits, target):
        torch._dynamo.mark_dynamic(x, 1)

    def loss(logits, target):
        out = cl.token_logprobs(logits, target, return_entropy=return_entropy, temperature=0.7)
        return sum(out).sum() if return_entropy else out.sum()

    compiled = torch.compile(loss, fullgraph=True)
    step = (lambda: torch.autograd.grad(compiled(logits, target), logits)) if backward else (
        lambda: compiled(logits, target)
    )
    torch._dynamo.reset()
    _, sources = run_and_get_code(step)
    widths = [
        int(shape.rsplit(",", 1)[-1])
        for source in sources
        for shape in re.findall(r"empty_strided_cpu\(\((\d[^)]*)\)", source)
        if shape.rsplit(",", 1)[-1].strip().isdigit()
    ]
    assert widths, "no buffers found: has Inductor's wrapper code changed?"
    wide = [width for width in widths if width > 16 and width != WIDE_VOCAB]
    assert not wide, f"[B, S, {wide}] buffers in the compiled code (of widths {widths})"
    assert widths.count(WIDE_VOCAB) == int(backward), f"[B, S, V] buffers: {widths}"
