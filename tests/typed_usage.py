"""A typed user's script: tests/test_types.py checks it with mypy and runs it."""

from __future__ import annotations

import torch

import compiled_logprob as cl
from compiled_logprob import nemo_compat


def main() -> None:
    logits = torch.randn(2, 8, 32, requires_grad=True)  # [B, S, V], one unsharded vocabulary
    target = torch.randint(0, 32, (2, 8))

    logprobs: torch.Tensor = cl.token_logprobs(logits, target)
    logprobs.sum().backward()

    logprobs, entropy = cl.token_logprobs(logits, target, return_entropy=True, temperature=0.7)
    (logprobs.sum() - 0.01 * entropy.mean()).backward()

    next_token: torch.Tensor = cl.context_parallel_logprobs(logits, target)  # [B, S - 1]
    assert next_token.shape == (2, 7)

    hidden, weight = torch.randn(2, 8, 16), torch.randn(32, 16)
    from_hidden = cl.lm_head_token_logprobs(hidden, weight, target, chunk_size=4)
    assert torch.allclose(from_hidden, cl.token_logprobs(hidden @ weight.T, target), atol=1e-5)

    top_logprobs, top_ids = cl.vocab_parallel_topk(logits, 3)
    assert top_ids.dtype == torch.int64 and top_logprobs.shape == (2, 8, 3)

    dropped_in: torch.Tensor = nemo_compat.from_parallel_logits_to_logprobs(
        logits, target, 0, 32, tp_group=None
    )
    assert torch.allclose(dropped_in, next_token)


if __name__ == "__main__":
    main()
