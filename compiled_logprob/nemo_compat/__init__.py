"""Drop-in replacements for the public names of NeMo-RL's ``nemo_rl/distributed/model_utils.py``.

Same signatures and semantics (positional arguments included) as NeMo-RL's current ones,
which accept every call of the Aug 2025 ones, as thin wrappers over the functional API. What
differs, on purpose:

* a target id outside the full vocabulary is an error, not a silent log-prob of 0;
* ``group=None`` (or a group of size 1) means an unsharded vocabulary and needs no
  ``torch.distributed``;
* shards may be uneven: each rank passes its own ``vocab_start_index``/``vocab_end_index``;
* ``_get_tokens_on_this_cp_rank`` raises a ``ValueError`` for a sequence length that is not a
  multiple of ``2 * cp_size``, where NeMo-RL silently drops the remainder (with
  ``cp_size == 1`` both return ``input_ids`` as it is, whatever ``cp_rank``);
* ``AllGatherCPTensor.apply`` and ``allgather_cp_sharded_tensor`` with ``cp_group=None``
  gather over the default (WORLD) group, as NeMo-RL, when torch.distributed is initialised;
  without it (where NeMo-RL raises) they return the tensor as it is;
* under top-k/top-p filtering (``sampling_params``, ``DistributedLogprobWithSampling``),
  tied logits at the top-k or top-p boundary are kept or dropped together, where NeMo-RL's
  sort decides among them; top-p sums fp32 probabilities (NeMo-RL: the logits' dtype); a
  target filtered out gets log-prob ``-inf`` and no gradient (NeMo-RL: ``-inf``, and the
  gradient of ``z_target − lse`` at the kept ids); ``B * S`` need not divide by the TP size;
* ``get_distillation_topk_logprobs_from_logits`` refuses ``calculate_entropy`` without
  ``zero_outside_topk`` (NeMo-RL fails on ``None`` there) and handles CP on every layout;
* ``ChunkedDistributedHiddenStatesToLogprobs`` and ``from_parallel_hidden_states_to_logprobs``
  accept ``chunk_size=None`` (a 64 MiB logits tile) and a ``tp_group`` of ``None`` (an
  unsharded vocabulary; NeMo-RL gathers over WORLD there), and sum the weight's gradient over
  chunks in fp32;
* everything traces under ``torch.compile(fullgraph=True)`` with no host syncs.

``top_k`` of 0 (or -1) filters nothing, as in NeMo-RL. ``patch_gpt_model_forward_for_linear_ce_fusion``
(a Megatron model patch) is out of scope (docs/nemo-rl.md).

The classes exist only so that ``X.apply(...)`` call sites keep working; they are not
``torch.autograd.Function`` subclasses (autograd lives in the custom ops).
"""

from compiled_logprob.nemo_compat._collectives import (
    all_to_all_sq2vp,
    all_to_all_vp2sq,
    cp_load_balanced_to_contiguous,
    cp_shift_next,
    group_all_reduce_sum,
    group_all_reduce_sum_with_grad,
    vocab_parallel_argmax,
    vocab_parallel_gather_columns,
)
from compiled_logprob.nemo_compat._distillation import (
    _student_layout,
    distributed_vocab_topk,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
)
from compiled_logprob.nemo_compat._hidden_states import (
    ChunkedDistributedHiddenStatesToLogprobs,
    from_parallel_hidden_states_to_logprobs,
)
from compiled_logprob.nemo_compat._logprobs import (
    ChunkedDistributedEntropy,
    ChunkedDistributedGatherLogprob,
    ChunkedDistributedLogprob,
    ChunkedDistributedLogprobWithSampling,
    DistributedCrossEntropy,
    DistributedLogprob,
    DistributedLogprobWithSampling,
    _compute_distributed_log_softmax,
    _compute_distributed_log_softmax_with_grad,
    vocab_parallel_full_log_softmax,
    vocab_parallel_log_softmax,
)
from compiled_logprob.nemo_compat._sequences import (
    AllGatherCPTensor,
    _get_tokens_on_this_cp_rank,
    allgather_cp_sharded_tensor,
    dtensor_from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    get_logprobs_from_vocab_parallel_logits,
    get_next_token_logprobs_from_logits,
)

__all__ = [
    "AllGatherCPTensor",
    "ChunkedDistributedEntropy",
    "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedHiddenStatesToLogprobs",
    "ChunkedDistributedLogprob",
    "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy",
    "DistributedLogprob",
    "DistributedLogprobWithSampling",
    "_compute_distributed_log_softmax",
    "_compute_distributed_log_softmax_with_grad",
    "_get_tokens_on_this_cp_rank",
    "_student_layout",
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "allgather_cp_sharded_tensor",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "distributed_vocab_topk",
    "dtensor_from_parallel_logits_to_logprobs",
    "from_parallel_hidden_states_to_logprobs",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "gather_logits_at_global_indices",
    "get_distillation_topk_logprobs_from_logits",
    "get_logprobs_from_vocab_parallel_logits",
    "get_next_token_logprobs_from_logits",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
    "vocab_parallel_argmax",
    "vocab_parallel_full_log_softmax",
    "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
]
