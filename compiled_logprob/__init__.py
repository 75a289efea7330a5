"""Compile-native vocab-parallel token log-probs for RL post-training.

The functional API, by module: ``logits`` (token log-probs, logsumexp, entropy, top-k,
log-softmax and cross-entropy of vocab-sharded logits), ``raw_logits`` (the logits
themselves across shards), ``context_parallel`` and ``packed`` (next-token log-probs across
CP ranks), ``dtensor``, ``lm_head`` and ``lm_head_distillation`` (from hidden states, no logits) and ``sampler`` (an
inference engine's side: bitwise the trainer's log-probs); ``check_ranks`` turns on the
cross-rank agreement check. NeMo-RL's names live in
:mod:`compiled_logprob.nemo_compat`. docs/ has the rest.
"""

from typing import TYPE_CHECKING

# First: an old torch is refused before any op is registered.
from compiled_logprob import _torch_compat  # noqa: F401  isort: skip
from compiled_logprob._agreement import check_ranks
from compiled_logprob.context_parallel import (
    context_parallel_logprobs,
    gather_context_parallel,
    shard_for_context_parallel,
)
from compiled_logprob.dtensor import dtensor_logprobs, vocab_shard_bounds
from compiled_logprob.lm_head import lm_head_token_logprobs, lm_head_topk
from compiled_logprob.lm_head_context_parallel import (
    lm_head_context_parallel_logprobs,
    lm_head_packed_context_parallel_logprobs,
)
from compiled_logprob.lm_head_distillation import lm_head_cross_entropy
from compiled_logprob.logits import (
    token_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_log_softmax,
    vocab_parallel_logsumexp,
    vocab_parallel_topk,
)
from compiled_logprob.packed import packed_context_parallel_logprobs
from compiled_logprob.sampler import sampler_logprobs
from compiled_logprob.raw_logits import (
    gather_vocab_parallel,
    vocab_parallel_logits_at,
    vocab_parallel_topk_logits,
)

__version__ = "0.1.0"

__all__ = [
    "check_ranks",
    "context_parallel_logprobs",
    "dtensor_logprobs",
    "gather_context_parallel",
    "gather_vocab_parallel",
    "lm_head_context_parallel_logprobs",
    "lm_head_cross_entropy",
    "lm_head_packed_context_parallel_logprobs",
    "lm_head_token_logprobs",
    "lm_head_topk",
    "packed_context_parallel_logprobs",
    "sampler_logprobs",
    "shard_for_context_parallel",
    "token_logprobs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logits_at",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
    "vocab_parallel_topk_logits",
    "vocab_shard_bounds",
]


# Hidden from type checkers: a module __getattr__ would type every misspelt name as Any.
if not TYPE_CHECKING:

    def __getattr__(name: str):
        """NeMo-RL's drop-in names from the top level, for one more release, with a warning."""
        import importlib

        nemo_compat = importlib.import_module("compiled_logprob.nemo_compat")
        if name in nemo_compat.__all__ and name not in __all__:
            import warnings

            warnings.warn(
                f"compiled_logprob.{name} is deprecated: import it from compiled_logprob.nemo_compat "
                "(which mirrors nemo_rl.distributed.model_utils)",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(nemo_compat, name)
        raise AttributeError(f"module 'compiled_logprob' has no attribute {name!r}")
