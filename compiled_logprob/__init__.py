"""Compile-native vocab-parallel token log-probs for RL post-training.

The functional API (``token_logprobs``, the context-parallel and DTensor entry points,
``lm_head_token_logprobs``, ``lm_head_topk``) is the core; the NeMo-RL names
(``DistributedLogprob`` …) are drop-in wrappers over it.
"""

# First: an old torch is refused before any op is registered.
from compiled_logprob import _torch_version  # noqa: F401
from compiled_logprob.context_parallel import (
    context_parallel_logprobs,
    gather_context_parallel,
    packed_context_parallel_logprobs,
    shard_for_context_parallel,
)
from compiled_logprob.core import (
    token_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_log_softmax,
    vocab_parallel_logsumexp,
    vocab_parallel_topk,
)
from compiled_logprob.dtensor import dtensor_logprobs, vocab_shard_bounds
from compiled_logprob.lm_head import (
    lm_head_context_parallel_logprobs,
    lm_head_packed_context_parallel_logprobs,
    lm_head_token_logprobs,
    lm_head_topk,
)
from compiled_logprob.nemo_compat import (
    AllGatherCPTensor,
    ChunkedDistributedEntropy,
    ChunkedDistributedGatherLogprob,
    ChunkedDistributedLogprob,
    ChunkedDistributedLogprobWithSampling,
    DistributedCrossEntropy,
    DistributedLogprob,
    DistributedLogprobWithSampling,
    _compute_distributed_log_softmax,
    _compute_distributed_log_softmax_with_grad,
    _get_tokens_on_this_cp_rank,
    all_to_all_sq2vp,
    all_to_all_vp2sq,
    allgather_cp_sharded_tensor,
    cp_load_balanced_to_contiguous,
    cp_shift_next,
    distributed_vocab_topk,
    dtensor_from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
    get_logprobs_from_vocab_parallel_logits,
    get_next_token_logprobs_from_logits,
    group_all_reduce_sum,
    group_all_reduce_sum_with_grad,
    vocab_parallel_argmax,
    vocab_parallel_gather_columns,
)

__version__ = "0.1.0"

__all__ = [
    "AllGatherCPTensor",
    "ChunkedDistributedEntropy",
    "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedLogprob",
    "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy",
    "DistributedLogprob",
    "DistributedLogprobWithSampling",
    "_compute_distributed_log_softmax",
    "_compute_distributed_log_softmax_with_grad",
    "_get_tokens_on_this_cp_rank",
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "allgather_cp_sharded_tensor",
    "context_parallel_logprobs",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "distributed_vocab_topk",
    "dtensor_from_parallel_logits_to_logprobs",
    "dtensor_logprobs",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "gather_context_parallel",
    "gather_logits_at_global_indices",
    "get_distillation_topk_logprobs_from_logits",
    "get_logprobs_from_vocab_parallel_logits",
    "get_next_token_logprobs_from_logits",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
    "lm_head_context_parallel_logprobs",
    "lm_head_packed_context_parallel_logprobs",
    "lm_head_token_logprobs",
    "lm_head_topk",
    "packed_context_parallel_logprobs",
    "shard_for_context_parallel",
    "token_logprobs",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
    "vocab_shard_bounds",
]
