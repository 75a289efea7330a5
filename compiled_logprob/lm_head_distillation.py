"""The distillation cross-entropy straight from two models' hidden states: neither's logits
ever exist.

Distilling over the full vocabulary needs, per position, every entry of both the teacher's
and the student's softmax; at 150k+ vocabularies their ``[B, S, V]`` logits (and the
student's gradient) dominate memory. :func:`lm_head_cross_entropy` walks the sequence in
chunks, forms both logits tiles per chunk, reduces them to per-row statistics and drops them;
the backward recomputes them.

Shape legend: ``B`` batch, ``S`` sequence (this rank's positions), ``H``/``H_t`` the
student's/teacher's hidden size, ``V_local`` this rank's vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_logprob import _agreement, _validation
from compiled_logprob._ops.lm_head_cross_entropy import lm_head_cross_entropy_of
from compiled_logprob._validation import head_options
from compiled_logprob.lm_head import check_hidden, whole_sequence

__all__ = ["lm_head_cross_entropy"]


@_agreement.agreed
def lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    sequence_parallel: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of the teacher's softmax relative to the student's over the full
    (sharded) vocabulary, fp32 ``[..., S]``, from both models' hidden states.

    Eager equivalent: ``vocab_parallel_cross_entropy(hidden @ weight.T, teacher_hidden @ teacher_weight.T, ...)``,
    i.e. ``-(softmax(full_teacher / T, -1) * log_softmax(full_student / T, -1)).sum(-1)`` with
    ``full_student = (hidden @ full_weight.T).float()`` (likewise the teacher's) — without
    ever materialising either's logits.

    Args:
        hidden: ``[..., S, H]``, the student's final hidden states, the same on every rank of
            ``group`` (with ``sequence_parallel``, this rank's ``[..., S / TP, H]``).
        weight: ``[V_local, H]``, this rank's slice of the student's LM-head weight, in
            ``hidden``'s dtype.
        teacher_hidden: ``[..., S, H_t]``, the teacher's, at the same positions and sharded
            the same way (any floating dtype and hidden size).
        teacher_weight: ``[V_local, H_t]``, this rank's slice of the teacher's LM-head weight
            (the same vocabulary slice), in ``teacher_hidden``'s dtype.
        group: the vocab-parallel group; ``None`` (or size 1): the vocabulary is not sharded.
        chunk_size: positions per chunk, as in
            :func:`compiled_logprob.lm_head_token_logprobs` (both models' tiles are blocks of
            the vocabulary of about ``2**24`` entries each).
        temperature: both softmaxes are of ``logits / temperature``; a float or a tensor that
            broadcasts to ``[..., S]``.
        sequence_parallel: both models' hidden states are this rank's contiguous ``1 / TP``
            of the sequence, gathered over ``group`` inside (as in
            :func:`~compiled_logprob.lm_head_token_logprobs`); the result covers the whole
            sequence.
        logits_dtype: ``None`` (each model's logits in its inputs' dtype) or
            ``torch.float32`` (both accumulated and kept in fp32).

    Differentiable with respect to the student's ``hidden`` and ``weight`` and, where they
    require grad, the teacher's (detach them for a fixed teacher: no teacher gradient is
    formed then). One all-gather of ``[..., S, 5]`` statistics; the backward recomputes each
    chunk's tiles and all-reduces each hidden-state gradient over ``group``. Every position
    stands alone, so context-parallel and packed layouts need nothing more: the result is in
    the hidden states' layout (:func:`~compiled_logprob.gather_context_parallel` brings a
    load-balanced one to natural order).
    """
    check_hidden(hidden, weight)
    check_hidden(teacher_hidden, teacher_weight, "teacher_hidden", "teacher_weight")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1] or teacher_hidden.device != hidden.device:
        raise ValueError(
            f"teacher_hidden ({tuple(teacher_hidden.shape)} on {teacher_hidden.device}) must have "
            f"the student's leading shape {tuple(hidden.shape[:-1])} and device {hidden.device}: "
            "the same positions"
        )
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher_weight holds {teacher_weight.shape[0]} vocabulary entries, the student's "
            f"weight {weight.shape[0]}: pass both models' slices of the same vocabulary shard"
        )
    opts = _validation.options(group=group, chunk_size=chunk_size)
    head = head_options(hidden, sequence_parallel, logits_dtype)
    teacher_head = head_options(
        teacher_hidden, sequence_parallel, torch.float32 if logits_dtype == torch.float32 else None
    )
    hidden = whole_sequence(hidden, opts, head)
    teacher_hidden = whole_sequence(teacher_hidden, opts, teacher_head)
    leading = hidden.shape[:-1]
    stats = lm_head_cross_entropy_of(
        _validation.as_batch(hidden, 2),
        weight,
        _validation.as_batch(teacher_hidden, 2),
        teacher_weight,
        _validation.temperature_rows(temperature, leading, hidden.device, "hidden states"),
        group_name=opts.group_name,
        chunk_size=opts.chunk_size,
        sequence_parallel=head.sequence_parallel,
        logits_dtype=head.logits_dtype,
        teacher_logits_dtype=teacher_head.logits_dtype,
    )
    return stats.cross_entropy.view(leading)
