"""Drop-in replacements for TRL's log-prob and entropy helpers, over the functional API.

Swap the import and keep the call sites::

    # from trl.trainer.utils import selective_log_softmax, entropy_from_logits
    from compiled_logprob.trl_compat import selective_log_softmax, entropy_from_logits

Both mirror ``trl/trainer/utils.py`` (whole-vocabulary logits, as GRPOTrainer computes them).
What differs, on purpose (docs/trl.md):

* the results are fp32, from fp32 math whatever the logits' dtype (TRL's return the
  logits' dtype: bf16 log-probs round to 2-3 significant digits);
* an index outside ``[0, V)`` is an error, detected on the device;
* one pass over the logits: no per-row Python loop (TRL loops over the batch in bf16), and
  ``chunk_size`` counts positions along the sequence (TRL: rows of the flattened logits),
  bounding the eager temporaries alike;
* everything traces under ``torch.compile(fullgraph=True)`` with no host syncs.
"""

from __future__ import annotations

import torch

from compiled_logprob import logits as _logits

__all__ = ["entropy_from_logits", "selective_log_softmax"]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Drop-in for TRL's ``selective_log_softmax``: fp32 ``log_softmax(logits, -1)`` gathered at
    ``index``, of ``index``'s shape: ``[...]`` (one id per position) or ``[..., K]`` (``K``
    ids per position) for ``logits`` ``[..., V]``."""
    return _logits.token_logprobs(logits, index)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Drop-in for TRL's ``entropy_from_logits``: the fp32 entropy of ``softmax(logits, -1)``
    at each position, ``[...]`` for ``logits`` ``[..., V]``, ``chunk_size`` positions at a
    time in eager."""
    return _logits.vocab_parallel_entropy(logits, chunk_size=chunk_size)
