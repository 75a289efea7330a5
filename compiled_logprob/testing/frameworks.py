"""verl's and TRL's log-prob and entropy helpers, restated from their source (the tests'
semantics and the benchmarks' baselines; neither package is needed).

verl: ``verl/utils/torch_functional.py`` at b178a3c, the fallbacks it takes without
flash-attn (``logprobs_from_logits_v2``, ``entropy_from_logits``,
``entropy_from_logits_with_chunking``). TRL: ``trl/trainer/utils.py`` at f2cd577
(``selective_log_softmax``, ``entropy_from_logits``). Each keeps its source's dtypes and
loops: a logsumexp per row in fp32, a log-softmax per row in bf16, results in the logits'
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def verl_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``logprobs_from_logits_v2``: ``labels`` ``[...]`` of ``logits`` ``[..., V]``."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, -1) for row in logits])
    rows = [F.log_softmax(r, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1) for r, y in zip(logits, labels)]
    return torch.stack(rows)


def verl_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits``, in the logits' dtype."""
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def verl_entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's ``entropy_from_logits_with_chunking`` of ``[N, V]`` logits: fp32 ``[N]``."""
    entropy = torch.zeros(logits.shape[0], device=logits.device)
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size].float()
        chunk_entropy = torch.logsumexp(chunk, -1) - (torch.softmax(chunk, -1) * chunk).sum(-1)
        entropy[start : start + chunk_size] = chunk_entropy
    return entropy


def trl_selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax``: ``index`` ``[...]`` or ``[..., K]``."""
    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, index)
        out = picked - torch.stack([torch.logsumexp(row, -1) for row in logits]).unsqueeze(-1)
    else:
        out = torch.stack([F.log_softmax(r, -1).gather(-1, i) for r, i in zip(logits, index)])
    return out.squeeze(-1) if squeeze else out


def trl_entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL's ``entropy_from_logits``: ``chunk_size`` rows of the flattened logits at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, 0):
        log_p = F.log_softmax(chunk, -1)
        parts.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])
