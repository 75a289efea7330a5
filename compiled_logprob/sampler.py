"""The inference engine's side of batch invariance: log-probs of sampled tokens on the full
logits, as a sampler holds them, bitwise the trainer's for the same logits.

An engine scores each step's batch of requests, whatever their number; the trainer scores
whole sequences, sharded over TP and CP ranks, chunked and packed. Every entry point of this
package reduces a row in one fixed order (docs/design.md, "Batch invariance"), so the two
agree to the bit: on-policy RL with a probability ratio of exactly 1 before the update.
"""

from __future__ import annotations

import torch

from compiled_logprob import _validation
from compiled_logprob.logits import token_logprobs

__all__ = ["sampler_logprobs"]


def sampler_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Log-probs of the sampled ``token_ids`` under full logits, fp32 ``[N]`` (or ``[N, K]``).

    Eager equivalent: ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, token_ids[:, None])[:, 0]``.

    The same bits as the trainer's :func:`~compiled_logprob.token_logprobs` (and every other
    entry point) for the same row of logits, whatever the number of rows here or there, the
    trainer's chunking, packing and CP degree, and its TP degree when every shard starts at
    a multiple of ``TILE_WIDTH`` (1024) ids: run both eager, or both compiled, on the same
    kind of device (docs/design.md, "Batch invariance").

    Args:
        logits: ``[N, V]`` full-vocabulary logits, one row per request (e.g. a vLLM logits
            processor's), any float dtype.
        token_ids: ``[N]`` sampled ids, or ``[N, K]`` several per row.
        temperature: a float, or a tensor ``[N]`` (one per request): the log-probs of
            ``softmax(logits / temperature)``, the distribution sampled from.
        top_k, top_p: the sampler's filters, for log-probs under the filtered distribution
            (``-inf`` for ids it filters out), as in :func:`~compiled_logprob.token_logprobs`.
    """
    _validation.check_logits(logits)
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be [N, V] (one row per request), got shape {tuple(logits.shape)}: "
            "for [B, S, V] logits call compiled_logprob.token_logprobs"
        )
    return token_logprobs(logits, token_ids, temperature=temperature, top_k=top_k, top_p=top_p)
