"""NeMo-RL's distillation helpers: the top-k logits, the logits at given ids, and the
student's and teacher's log-probs at the teacher's top-k."""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compiled_logprob import _validation, context_parallel, dtensor, raw_logits
from compiled_logprob import logits as core
from compiled_logprob.nemo_compat._arguments import even_shard_start, this_shard


def distributed_vocab_topk(
    vocab_parallel_logits: torch.Tensor,
    k: int,
    tp_group: dist.ProcessGroup | None,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for NeMo-RL's ``distributed_vocab_topk``: the global top ``k`` logits over the
    sharded vocabulary, fp32 ``[B, S, k]`` in decreasing order, and their int64 global ids.

    The logits themselves, not differentiable (:func:`compiled_logprob.vocab_parallel_topk`
    gives log-probs with gradients). ``k`` at most this rank's ``V_local`` (every rank's: with
    uneven shards, the smallest). One all-gather of ``[B, S, 2k]`` candidates, which the
    block maxima of :func:`compiled_logprob.vocab_parallel_topk` select; ``chunk_size`` is
    NeMo-RL's, and bounds nothing here: no ``[B, S, V_local]`` temporary is made.
    """
    logits, start = this_shard(vocab_parallel_logits, vocab_start_index, vocab_end_index, True)
    _validation.check_logits(logits)
    return raw_logits.vocab_parallel_topk_logits(logits, k, vocab_start=start, group=tp_group)


def gather_logits_at_global_indices(
    vocab_parallel_logits: torch.Tensor,
    global_indices: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``gather_logits_at_global_indices``: the logits at K global ids per
    position, fp32 ``[B, S, K]``, of ``[B, S / CP, V_local]`` load-balanced logits and the full
    ``global_indices`` ``[B, S, K]`` (natural order).

    Differentiable: each rank's logits receive the upstream gradient at the ids they own
    (summed over its CP group at its positions, as the CP gather's backward sums). An id that
    no rank owns is an error (on the device), not a logit of 0. One all-reduce of ``[B, S / CP,
    2K]`` over TP and one all-gather over CP; ``chunk_size`` is NeMo-RL's and bounds nothing:
    K entries per row are gathered.
    """
    logits, start = this_shard(vocab_parallel_logits, vocab_start_index, vocab_end_index, False)
    _validation.check_logits(logits)
    _validation.check_token_ids(global_indices, "global_indices")
    if global_indices.dim() != 3 or global_indices.shape[0] != logits.shape[0]:
        raise ValueError(
            f"global_indices must be [B, S, K] with the logits' B, got "
            f"{tuple(global_indices.shape)} for logits {tuple(logits.shape)}"
        )
    seq_len = global_indices.shape[1]
    global_indices = context_parallel.shard_natural(global_indices, logits.shape[1], cp_group)
    picked, verdict = raw_logits.logits_at_unchecked(
        logits, global_indices, vocab_start=start, group=tp_group
    )
    return context_parallel.gather_checked(picked, verdict, seq_len, cp_group)


@overload
def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: Literal[False],
    vocab_parallel_rank: int | None = ...,
    vocab_parallel_group: dist.ProcessGroup | None = ...,
    context_parallel_group: dist.ProcessGroup | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, None]: ...


@overload
def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: Literal[True],
    vocab_parallel_rank: int | None = ...,
    vocab_parallel_group: dist.ProcessGroup | None = ...,
    context_parallel_group: dist.ProcessGroup | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: int | None = ...,
    vocab_parallel_group: dist.ProcessGroup | None = ...,
    context_parallel_group: dist.ProcessGroup | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: dist.ProcessGroup | None = None,
    context_parallel_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop-in for NeMo-RL's ``get_distillation_topk_logprobs_from_logits``: the student's and
    the teacher's log-probs at the teacher's top-k ids, ``(student [B, S - 1, K], teacher
    [B, S - 1, K], H_all)``, all fp32.

    ``student_logits`` ``[B, S / CP, V_local]``: this rank's even vocabulary shard
    ``[vocab_parallel_rank · V_local, …)`` with ``vocab_parallel_group``, a DTensor sharded on
    the vocabulary over mesh axis ``"tp"`` (CP over its ``"cp"`` axis if any), or unsharded
    ``[B, S / CP, V]``; load-balanced over ``context_parallel_group`` (the DTensor's
    ``"cp"`` axis). ``teacher_topk_logits`` and ``teacher_topk_indices`` (global ids)
    ``[B, S, K]`` are the teacher's at the same, unshifted, natural-order positions: the
    last position is dropped from every output, none is rolled.

    With ``zero_outside_topk``, the student's log-probs are over the full vocabulary (its
    mass outside the top-k counts), and ``calculate_entropy`` adds ``H_all = Σ q log q``
    ``[B, S - 1]``, the student's negative entropy, from the same pass; without, they are
    renormalised over the K ids (``log_softmax`` of the student's logits there), and
    ``calculate_entropy`` is refused (NeMo-RL fails on ``None`` there). The teacher's are
    always renormalised over its K. Differentiable in the student's logits.
    """
    if teacher_topk_indices.dim() != 3 or teacher_topk_indices.shape[-1] == 0:
        raise ValueError(
            f"teacher_topk_indices must be [B, S, K] with K >= 1, got shape "
            f"{tuple(teacher_topk_indices.shape)}"
        )
    if teacher_topk_logits.shape != teacher_topk_indices.shape:
        raise ValueError(
            f"teacher_topk_logits {tuple(teacher_topk_logits.shape)} must have the shape of "
            f"teacher_topk_indices {tuple(teacher_topk_indices.shape)}: the teacher's logit at "
            "each of its top-k ids"
        )
    if calculate_entropy and not zero_outside_topk:
        raise ValueError(
            "calculate_entropy=True needs zero_outside_topk=True: the entropy is of the "
            "student's full-vocabulary distribution"
        )
    logits, start, group, cp_group = _student_layout(
        student_logits, vocab_parallel_rank, vocab_parallel_group, context_parallel_group
    )
    ids = teacher_topk_indices.to(logits.device)
    seq_len = ids.shape[1]
    entropy = None
    if zero_outside_topk:
        local = context_parallel.shard_natural(ids, logits.shape[1], cp_group)
        scored = core.scored_token_logprobs(
            logits, local, vocab_start=start, group=group, return_entropy=calculate_entropy
        )
        # The verdict is asserted after the CP gather: every CP rank raises together.
        values = scored.logprobs
        if scored.entropy is not None:
            values = torch.cat([values, scored.entropy.unsqueeze(-1)], dim=-1)
        values = context_parallel.gather_checked(values, scored.verdict, seq_len, cp_group)
        student = values[..., : ids.shape[-1]]
        if calculate_entropy:
            entropy = -values[:, :-1, -1]
    else:
        student = gather_logits_at_global_indices(
            logits, ids, group, cp_group,
            vocab_start_index=start, vocab_end_index=start + logits.shape[-1],
        ).log_softmax(-1)
    teacher = teacher_topk_logits.to(student.device, torch.float32).log_softmax(-1)
    return student[:, :-1], teacher[:, :-1], entropy


def _student_layout(student_logits, vocab_parallel_rank, vocab_parallel_group, cp_group):
    """``(logits, vocab_start, tp_group, cp_group)`` of the three layouts that
    :func:`get_distillation_topk_logprobs_from_logits` takes."""
    if vocab_parallel_group is not None:
        start = even_shard_start(student_logits, vocab_parallel_rank)
        return student_logits, start, vocab_parallel_group, cp_group
    if isinstance(student_logits, DTensor):
        start, _ = dtensor.vocab_shard_bounds(student_logits)
        mesh = student_logits.device_mesh
        cp_group = mesh.get_group("cp") if "cp" in (mesh.mesh_dim_names or ()) else None
        return student_logits.to_local(), start, mesh.get_group("tp"), cp_group
    return student_logits, 0, None, cp_group
