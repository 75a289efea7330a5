"""Compile-native vocab-parallel token log-probs for RL post-training.

The functional API (``token_logprobs`` and friends) is the core; the NeMo-RL names
(``DistributedLogprob`` …) are drop-in wrappers over it.
"""

from compiled_logprob.core import token_logprobs, vocab_parallel_log_softmax, vocab_parallel_logsumexp
from compiled_logprob.nemo_compat import (
    ChunkedDistributedLogprob,
    DistributedLogprob,
    _compute_distributed_log_softmax,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkedDistributedLogprob",
    "DistributedLogprob",
    "_compute_distributed_log_softmax",
    "token_logprobs",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logsumexp",
]
