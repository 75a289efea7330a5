"""Bad input fails early with a ``ValueError``/``TypeError`` that names the offending values
and the fix; a target outside the vocabulary fails on the device, eager and compiled; empty
input is not an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import SamplingParams, check_message

import compiled_logprob as cl
from compiled_logprob import _torch_compat
from compiled_logprob._math import kernels
from compiled_logprob._math.merge import OWNERSHIP_ERROR

LOGITS = torch.randn(2, 5, 7)
TARGET = torch.randint(0, 7, (2, 5))


def _token_logprobs(logits=LOGITS, target=TARGET, **options):
    return lambda: cl.token_logprobs(logits, target, **options)


def _cp_logprobs(logits=LOGITS, input_ids=TARGET, **options):
    return lambda: cl.context_parallel_logprobs(logits, input_ids, **options)


def _packed_logprobs(**options):
    return lambda: cl.packed_context_parallel_logprobs(
        LOGITS[:1], TARGET[:1], torch.tensor([0, 5]), **options
    )


# name: (call, exception type, substrings the message must contain)
CASES = {
    "logits_int": (
        _token_logprobs(logits=TARGET[..., None].expand(2, 5, 7)),
        TypeError,
        ["floating-point", "torch.int64"],
    ),
    "logits_not_tensor": (_token_logprobs(logits=[[1.0]]), TypeError, ["torch.Tensor", "list"]),
    "logits_1d": (
        lambda: cl.token_logprobs(torch.randn(7), torch.tensor(1)),
        ValueError,
        ["[..., S, V_local]", "(7,)"],
    ),
    "logits_1d_logsumexp": (
        lambda: cl.vocab_parallel_logsumexp(torch.randn(7)),
        ValueError,
        ["[..., S, V_local]", "(7,)"],
    ),
    "logits_0d_log_softmax": (
        lambda: cl.vocab_parallel_log_softmax(torch.tensor(1.0)),
        ValueError,
        ["[..., S, V_local]", "()"],
    ),
    "target_float": (_token_logprobs(target=TARGET.float()), TypeError, ["float32", ".long()"]),
    "target_bool": (_token_logprobs(target=TARGET > 3), TypeError, ["torch.bool", ".long()"]),
    "target_uint8": (_token_logprobs(target=TARGET.byte()), TypeError, ["torch.uint8", ".long()"]),
    "target_not_tensor": (_token_logprobs(target=[1, 2]), TypeError, ["torch.Tensor", "list"]),
    "target_shape": (
        _token_logprobs(target=TARGET[:, :4]),
        ValueError,
        ["(2, 4)", "(2, 5)", "(2, 5, 7)"],
    ),
    "target_device": (
        _token_logprobs(logits=LOGITS.to("meta")),
        ValueError,
        ["cpu", "meta", "same device"],
    ),
    "chunk_size_zero": (_token_logprobs(chunk_size=0), ValueError, ["chunk_size", ">= 1", "0"]),
    "chunk_size_negative": (
        lambda: cl.vocab_parallel_logsumexp(LOGITS, chunk_size=-1),
        ValueError,
        ["chunk_size", ">= 1", "-1"],
    ),
    "chunk_size_float": (_token_logprobs(chunk_size=2.5), TypeError, ["chunk_size", "int", "2.5"]),
    "chunk_size_str": (
        lambda: cl.vocab_parallel_log_softmax(LOGITS, chunk_size="4"),
        TypeError,
        ["chunk_size", "'4'"],
    ),
    "chunk_size_bool": (_token_logprobs(chunk_size=True), TypeError, ["chunk_size", "True"]),
    "vocab_start_negative": (
        _token_logprobs(vocab_start=-1),
        ValueError,
        ["vocab_start", ">= 0", "-1"],
    ),
    "vocab_start_float": (_token_logprobs(vocab_start=2.0), TypeError, ["vocab_start", "2.0"]),
    "vocab_start_bool": (_token_logprobs(vocab_start=True), TypeError, ["vocab_start", "True"]),
    "ignore_index_float": (
        _token_logprobs(ignore_index=3.0),
        TypeError,
        ["ignore_index", "must be an int", "3.0"],
    ),
    "ignore_index_tensor": (
        _token_logprobs(ignore_index=torch.tensor(3)),
        TypeError,
        ["ignore_index", "Python int", "tensor(3)"],
    ),
    "ignore_index_wraps_int32_target": (
        _token_logprobs(target=TARGET.int(), ignore_index=2**32),
        ValueError,
        ["ignore_index=4294967296", "torch.int32", "target.long()"],
    ),
    "empty_vocab_shard": (
        lambda: cl.vocab_parallel_logsumexp(torch.randn(2, 5, 0)),
        ValueError,
        ["(2, 5, 0)", "empty"],
    ),
    "log_softmax_dtype_int": (
        lambda: cl.vocab_parallel_log_softmax(LOGITS, dtype=torch.int64),
        TypeError,
        ["dtype", "floating-point", "torch.int64"],
    ),
    "log_softmax_dtype_str": (
        lambda: cl.vocab_parallel_log_softmax(LOGITS, dtype="float32"),
        TypeError,
        ["dtype", "'float32'"],
    ),
    "group_str": (_token_logprobs(group="tp"), TypeError, ["ProcessGroup or None", "str"]),
    "group_int_logsumexp": (
        lambda: cl.vocab_parallel_logsumexp(LOGITS, group=2),
        TypeError,
        ["ProcessGroup or None", "int"],
    ),
    "group_list_log_softmax": (
        lambda: cl.vocab_parallel_log_softmax(LOGITS, group=[0, 1]),
        TypeError,
        ["ProcessGroup or None", "list"],
    ),
    "group_distributed_logprob": (
        lambda: cl.DistributedLogprob.apply(LOGITS, TARGET, 0, 7, "tp"),
        TypeError,
        ["ProcessGroup or None", "str"],
    ),
    "group_chunked_distributed_logprob": (
        lambda: cl.ChunkedDistributedLogprob.apply(LOGITS, TARGET, 0, 7, 2, object()),
        TypeError,
        ["ProcessGroup or None", "object"],
    ),
    "group_compute_distributed_log_softmax": (
        lambda: cl._compute_distributed_log_softmax(LOGITS, 0),
        TypeError,
        ["ProcessGroup or None", "int"],
    ),
    "bounds_too_wide": (
        lambda: cl.DistributedLogprob.apply(LOGITS, TARGET, 0, 8, None),
        ValueError,
        ["8 - 0 = 8", "hold 7", "(2, 5, 7)", "own shard bounds"],
    ),
    "bounds_too_narrow_chunked": (
        lambda: cl.ChunkedDistributedLogprob.apply(LOGITS, TARGET, 3, 7, 2, None),
        ValueError,
        ["7 - 3 = 4", "hold 7", "own shard bounds"],
    ),
    "chunk_size_zero_chunked_distributed_logprob": (
        lambda: cl.ChunkedDistributedLogprob.apply(LOGITS, TARGET, 0, 7, 0, None),
        ValueError,
        ["chunk_size", "0"],
    ),
    "gather_logprob_one_id_per_position": (
        lambda: cl.ChunkedDistributedGatherLogprob.apply(LOGITS, TARGET, 0, 7, 2, None),
        ValueError,
        ["global_indices", "[B, S, K]", "(2, 5, 7)", "(2, 5)", "DistributedLogprob"],
    ),
    "gather_logprob_bounds": (
        lambda: cl.ChunkedDistributedGatherLogprob.apply(LOGITS, TARGET[..., None], 0, 6, 2, None),
        ValueError,
        ["6 - 0 = 6", "hold 7", "own shard bounds"],
    ),
    "top_p_zero": (
        lambda: cl.dtensor_from_parallel_logits_to_logprobs(
            LOGITS, TARGET, 0, 7, None, sampling_params=SamplingParams(top_p=0.0)
        ),
        ValueError,
        ["top_p must be in (0, 1]", "got 0.0"],
    ),
    "top_p_above_one": (
        lambda: cl.token_logprobs(LOGITS, TARGET, top_p=1.5),
        ValueError,
        ["top_p must be in (0, 1]", "got 1.5"],
    ),
    "top_p_not_a_number": (
        lambda: cl.context_parallel_logprobs(LOGITS, TARGET, top_p="0.9"),
        TypeError,
        ["top_p must be a float in (0, 1]", "'0.9'"],
    ),
    "top_k_negative": (
        lambda: cl.from_parallel_logits_to_logprobs(
            LOGITS, TARGET, 0, 7, None, False, None, None, SamplingParams(top_k=-2)
        ),
        ValueError,
        ["top_k must be >= 1, got -2"],
    ),
    "top_k_float": (
        lambda: cl.DistributedLogprobWithSampling.apply(LOGITS, TARGET, None, 2.5, 1.0),
        TypeError,
        ["top_k must be an int", "2.5"],
    ),
    "top_k_with_entropy": (
        lambda: cl.token_logprobs(LOGITS, TARGET, top_k=3, return_entropy=True),
        ValueError,
        ["return_entropy is not supported with top_k/top_p", "vocab_parallel_entropy"],
    ),
    "top_k_shard_not_in_rank_order": (
        lambda: cl.from_parallel_logits_to_logprobs_packed_sequences(
            LOGITS[:1], TARGET[:1], torch.tensor([0, 5]), 5, 3, 10, None,
            sampling_params=SamplingParams(top_k=1, top_p=0.5),
        ),
        ValueError,
        ["split evenly in rank order", "rank 0 of the group holds [3, 10)", "pad it"],
    ),
    "next_token_logprobs_without_rank": (
        lambda: cl.get_next_token_logprobs_from_logits(
            TARGET, LOGITS, vocab_parallel_group=object()
        ),
        ValueError,
        ["vocab_parallel_rank must be given", "[rank * V_local, (rank + 1) * V_local)"],
    ),
    "vocab_topk_k_above_shard": (
        lambda: cl.distributed_vocab_topk(LOGITS, 8, None, vocab_start_index=0, vocab_end_index=7),
        ValueError,
        ["k must be an int in [1, V_local = 7]", "got 8"],
    ),
    "gather_logits_one_id_per_position": (
        lambda: cl.gather_logits_at_global_indices(
            LOGITS, TARGET, None, vocab_start_index=0, vocab_end_index=7
        ),
        ValueError,
        ["global_indices must be [B, S, K]", "(2, 5)", "(2, 5, 7)"],
    ),
    "gather_logits_out_of_vocabulary": (
        lambda: cl.gather_logits_at_global_indices(
            LOGITS, torch.full((2, 5, 1), 7), None, vocab_start_index=0, vocab_end_index=7
        ),
        RuntimeError,
        ["not owned by exactly one vocabulary shard"],
    ),
    "pre_rolled_targets_not_local": (
        lambda: cl.from_parallel_logits_to_logprobs_packed_sequences(
            LOGITS[:1], TARGET[:1, :4], torch.tensor([0, 5]), 5, 0, 7, None,
            target_is_pre_rolled=True,
        ),
        ValueError,
        ["pre-rolled targets (1, 4)", "5 local positions", "(1, 5, 7)"],
    ),
    "get_tokens_cp_rank_float": (
        lambda: cl._get_tokens_on_this_cp_rank(TARGET, 1.0, 2, 1),
        TypeError,
        ["cp_rank", "int", "1.0"],
    ),
    "get_tokens_cp_size_tensor": (
        lambda: cl._get_tokens_on_this_cp_rank(TARGET, 0, torch.tensor(2), 1),
        TypeError,
        ["cp_size", "Python int", "tensor(2)"],
    ),
    "get_tokens_cp_rank_out_of_range": (
        lambda: cl._get_tokens_on_this_cp_rank(TARGET, 2, 2, 1),
        ValueError,
        ["cp_rank", "[0, cp_size = 2)", "got 2"],
    ),
    "get_tokens_length_not_multiple": (
        lambda: cl._get_tokens_on_this_cp_rank(TARGET, 0, 2, 1),
        ValueError,
        ["sequence length 5", "multiple of 2 * cp_size = 4", "pad"],
    ),
    "packed_max_seqlen_float": (
        _packed_logprobs(max_seqlen=5.0),
        TypeError,
        ["unpacked_seqlen/max_seqlen", "int", "5.0"],
    ),
    "packed_max_seqlen_zero": (
        _packed_logprobs(max_seqlen=0),
        ValueError,
        ["unpacked_seqlen/max_seqlen", ">= 1", "0"],
    ),
    "packed_unpacked_seqlen_bool": (
        lambda: cl.from_parallel_logits_to_logprobs_packed_sequences(
            LOGITS[:1], TARGET[:1], torch.tensor([0, 5]), True, 0, 7, None
        ),
        TypeError,
        ["unpacked_seqlen/max_seqlen", "True"],
    ),
    "drop_in_vocab_start_index_float": (
        lambda: cl.DistributedLogprob.apply(LOGITS, TARGET, 0.0, 7, None),
        TypeError,
        ["vocab_start_index", "int", "0.0"],
    ),
    "drop_in_vocab_end_index_tensor": (
        lambda: cl.from_parallel_logits_to_logprobs(LOGITS, TARGET, 0, torch.tensor(7), None),
        TypeError,
        ["vocab_end_index", "Python int", "tensor(7)"],
    ),
    "drop_in_vocab_start_index_negative": (
        lambda: cl.ChunkedDistributedLogprob.apply(LOGITS, TARGET, -1, 6, 2, None),
        ValueError,
        ["vocab_start_index", ">= 0", "-1"],
    ),
    "cp_logits_too_short_without_cp": (
        _cp_logprobs(input_ids=torch.zeros(2, 8, dtype=torch.long)),
        ValueError,
        ["hold 5 positions", "no CP", "fewer than the 8 positions", "(2, 8)"],
    ),
    "dtensor_drop_in_plain_target_too_long": (
        lambda: cl.dtensor_from_parallel_logits_to_logprobs(
            LOGITS, torch.zeros(2, 10, dtype=torch.long), 0, 7, None, seq_index=torch.arange(10)
        ),
        ValueError,
        ["hold 5 positions", "fewer than the 10", "(2, 10)", "plain tensor", "DTensor", "'cp'"],
    ),
    # seq_index: an int32/int64 permutation of the natural positions (here 0 .. 4).
    "seq_index_bool": (
        _cp_logprobs(seq_index=torch.ones(5, dtype=torch.bool)),
        TypeError,
        ["seq_index", "int32 or int64", "torch.bool"],
    ),
    "seq_index_float": (
        _cp_logprobs(seq_index=torch.arange(5.0)),
        TypeError,
        ["seq_index", "int32 or int64", "torch.float32"],
    ),
    "seq_index_list": (
        _cp_logprobs(seq_index=[0, 1, 2, 3, 4]),
        TypeError,
        ["seq_index", "int32 or int64", "list"],
    ),
    # Checked on the device (no host sync): torch._assert_async, a RuntimeError on the CPU.
    "seq_index_duplicates": (
        _cp_logprobs(seq_index=torch.tensor([0, 1, 1, 3, 4])),
        RuntimeError,
        ["seq_index", "permutation", "exactly once"],
    ),
    "seq_index_out_of_range": (
        _cp_logprobs(seq_index=torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)),
        RuntimeError,
        ["seq_index", "permutation"],
    ),
    "seq_index_negative": (
        _cp_logprobs(seq_index=torch.tensor([-1, 0, 1, 2, 3])),
        RuntimeError,
        ["seq_index", "permutation"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_message(case):
    check_message(*CASES[case])


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("shape", [(2, 0, 7), (0, 3, 7), (4, 2, 0, 7)])
def test_empty_input_is_not_an_error(shape, chunk_size):
    logits = torch.randn(shape, requires_grad=True)
    target = torch.zeros(shape[:-1], dtype=torch.long)
    logprobs = cl.token_logprobs(logits, target, chunk_size=chunk_size)
    logprobs.sum().backward()
    assert logprobs.shape == shape[:-1] and logits.grad.shape == shape


def _logprobs(logits, target):
    return cl.token_logprobs(logits, target)


def _chunked_logprobs(logits, target):
    return cl.token_logprobs(logits, target, chunk_size=2, ignore_index=-100)


# >= V, negative, and next to (but not equal to) the chunked call's ignore_index.
OUT_OF_VOCAB = (7, -1, -101)


@pytest.fixture(scope="module")
def compiled_logprobs():
    """Inductor compiles the device-side assertion itself: check it survives lowering."""
    torch._dynamo.reset()
    yield torch.compile(_logprobs, backend="inductor", fullgraph=True)
    torch._dynamo.reset()


def _assert_out_of_vocab_raises(call) -> None:
    logits = LOGITS.clone().requires_grad_()
    call(logits, TARGET)  # valid targets pass (and compile outside pytest.raises)
    for bad in OUT_OF_VOCAB:
        target = TARGET.clone()
        target[1, 3] = bad
        with pytest.raises(RuntimeError, match="not owned by exactly one vocabulary") as raised:
            call(logits, target)
        assert "ignore_index" in str(raised.value)


@pytest.mark.parametrize("fn", [_logprobs, _chunked_logprobs], ids=lambda fn: fn.__name__)
def test_out_of_vocab_target_raises_eager(fn):
    _assert_out_of_vocab_raises(fn)


def test_out_of_vocab_target_raises_compiled(compiled_logprobs):
    _assert_out_of_vocab_raises(compiled_logprobs)


def test_non_contiguous_inputs_are_accepted_and_exact():
    """Strided logits and targets (a vocab-major buffer, a sliced sequence) need no error:
    the ops read any strides. Only the summation order of a strided reduction differs, so
    the results agree with contiguous copies to a few fp32 ulps."""
    ulps = dict(rtol=4 * torch.finfo(torch.float32).eps, atol=4 * torch.finfo(torch.float32).eps)
    vocab_major = LOGITS.transpose(-1, -2).contiguous().transpose(-1, -2)
    strided = [(vocab_major, TARGET), (LOGITS[:, ::2], TARGET[:, ::2])]
    for logits, target in strided:
        assert not logits.is_contiguous()
        logits = logits.detach().requires_grad_()
        dense = logits.detach().contiguous().requires_grad_()
        got, want = cl.token_logprobs(logits, target), cl.token_logprobs(dense, target.contiguous())
        torch.testing.assert_close(got, want, **ulps)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(logits.grad, dense.grad, **ulps)


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0", (2, 13)), ("2.13.0a0+git1234", (2, 13)), ("2.14.1+cu128", (2, 14)), ("3.0", (3, 0))],
)
def test_torch_release(version, release):
    """Pre-releases and local builds (NGC's "2.13.0a0+…") count as their release."""
    assert _torch_compat.release(version) == release


IMPORT_ON_OLD_TORCH = "import torch; torch.__version__ = '2.11.0'; import compiled_logprob"


def test_old_torch_is_refused_at_import():
    """Older torch fails the suite (a missing collective, a wrong DTensor gradient): refuse it
    at import with the fix, not later with an AttributeError or wrong numbers."""
    result = subprocess.run([sys.executable, "-c", IMPORT_ON_OLD_TORCH], capture_output=True, text=True)
    assert result.returncode != 0
    assert "ImportError: compiled_logprob needs torch >= 2.12, found 2.11.0" in result.stderr
    assert "pip install 'torch>=2.12'" in result.stderr


def test_old_torch_is_allowed_with_a_warning_on_request():
    """``COMPILED_LOGPROB_ALLOW_OLD_TORCH=1`` (for measuring on an image with an older torch)
    imports with a warning that names the version, instead of refusing."""
    env = {**os.environ, "COMPILED_LOGPROB_ALLOW_OLD_TORCH": "1"}
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", IMPORT_ON_OLD_TORCH],
        capture_output=True, text=True, env=env, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "compiled_logprob needs torch >= 2.12, found 2.11.0; running anyway" in result.stderr


def test_device_side_messages_fit_cuda():
    """CUDA refuses a ``_assert_async`` message over 254 characters (every call would raise
    there, valid input included), so the package's checks refuse one on any device."""
    assert len(OWNERSHIP_ERROR) <= kernels.DEVICE_MESSAGE_LIMIT == 254
    kernels.assert_async(torch.tensor(True), "x" * 254)
    with pytest.raises(AssertionError, match="over 254 characters"):
        kernels.assert_async(torch.tensor(True), "x" * 255)
