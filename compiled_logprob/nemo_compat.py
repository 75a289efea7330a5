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
* everything traces under ``torch.compile(fullgraph=True)`` with no host syncs.

The classes exist only so that ``X.apply(...)`` call sites keep working; they are not
``torch.autograd.Function`` subclasses (autograd lives in the custom ops).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_logprob import _comm, _validation, context_parallel, dtensor, logits as core

__all__ = [
    "ChunkedDistributedEntropy",
    "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedLogprob",
    "ChunkedDistributedLogprobWithSampling",
    "DistributedLogprob",
    "DistributedLogprobWithSampling",
    "_compute_distributed_log_softmax",
    "_compute_distributed_log_softmax_with_grad",
]


def _this_shard(
    logits: torch.Tensor, vocab_start_index: int, vocab_end_index: int, inference_only: bool
) -> tuple[torch.Tensor, int]:
    """The logits (detached for ``inference_only``) and the shard's start as a Python int,
    after checking NeMo's redundant shard bounds against the shard's width."""
    vocab_start_index = _validation.as_int(vocab_start_index, "vocab_start_index", minimum=0)
    vocab_end_index = _validation.as_int(vocab_end_index, "vocab_end_index")
    width = logits.shape[-1]
    if vocab_end_index - vocab_start_index != width:
        raise ValueError(
            f"vocab_end_index - vocab_start_index = {vocab_end_index} - {vocab_start_index} = "
            f"{vocab_end_index - vocab_start_index}, but this rank's logits hold {width} vocabulary "
            f"entries (shape {tuple(logits.shape)}); pass this rank's own shard bounds"
        )
    return (logits.detach() if inference_only else logits), vocab_start_index


class DistributedLogprob:
    """Drop-in for NeMo-RL's ``DistributedLogprob``; see :func:`compiled_logprob.token_logprobs`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of ``target`` ``[B, S]`` from ``[B, S, V_local]`` logits."""
        return ChunkedDistributedLogprob.apply(
            vocab_parallel_logits,
            target,
            vocab_start_index,
            vocab_end_index,
            None,
            group,
            inference_only,
        )


class ChunkedDistributedLogprob:
    """Drop-in for NeMo-RL's ``ChunkedDistributedLogprob``: the same values as
    :class:`DistributedLogprob`, computed ``chunk_size`` sequence positions at a time."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs; no temporary exceeds ``O(B * chunk_size * V_local)``."""
        vocab_parallel_logits, start = _this_shard(
            vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
        )
        return core.token_logprobs(
            vocab_parallel_logits,
            target,
            vocab_start=start,
            group=tp_group,
            chunk_size=chunk_size,
        )


class DistributedLogprobWithSampling:
    """Drop-in for NeMo-RL's ``DistributedLogprobWithSampling``: log-probs under the top-k/top-p
    filtered distribution; see ``top_k``/``top_p`` of :func:`compiled_logprob.token_logprobs`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        top_k: int | None,
        top_p: float,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of ``target`` ``[B, S]`` from ``[B, S, V_local]`` logits,
        rank r of ``tp_group`` holding ids ``[r * V_local, (r + 1) * V_local)``."""
        return ChunkedDistributedLogprobWithSampling.apply(
            vocab_parallel_logits, target, tp_group, top_k, top_p, None, inference_only
        )


class ChunkedDistributedLogprobWithSampling:
    """Drop-in for NeMo-RL's ``ChunkedDistributedLogprobWithSampling``: the values of
    :class:`DistributedLogprobWithSampling`, ``chunk_size`` sequence positions at a time."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        top_k: int | None,
        top_p: float,
        chunk_size: int | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` filtered log-probs, as :class:`DistributedLogprobWithSampling`."""
        rank = 0 if _comm.group_name(tp_group) is None else tp_group.rank()
        logits = vocab_parallel_logits.detach() if inference_only else vocab_parallel_logits
        return core.token_logprobs(
            logits,
            target,
            vocab_start=rank * logits.shape[-1],
            group=tp_group,
            chunk_size=chunk_size,
            **_filter(top_k, top_p),
        )


def _filter(top_k: int | None, top_p: float | None) -> dict:
    """NeMo-RL's filter settings as :func:`compiled_logprob.token_logprobs` takes them: its
    ``top_k`` of ``None`` or -1 and ``top_p`` of ``None`` or 1.0 filter nothing."""
    return {"top_k": None if top_k == -1 else top_k, "top_p": 1.0 if top_p is None else top_p}


def _compute_distributed_log_softmax(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This shard of the full-vocabulary log-softmax, ``[B, S, V_local]`` in the logits' dtype.

    Drop-in for NeMo-RL's function of the same name (and differentiable, unlike its newest
    ``no_grad`` version).
    """
    return core.vocab_parallel_log_softmax(vocab_parallel_logits, group=group)


def _compute_distributed_log_softmax_with_grad(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's function of the same name: :func:`_compute_distributed_log_softmax`
    (differentiable either way here)."""
    return _compute_distributed_log_softmax(vocab_parallel_logits, group)


class ChunkedDistributedGatherLogprob:
    """Drop-in for NeMo-RL's ``ChunkedDistributedGatherLogprob``: log-probs at K global ids per
    position; see :func:`compiled_logprob.token_logprobs` with a ``[B, S, K]`` target."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        global_indices: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S, K]`` log-probs of ``global_indices`` ``[B, S, K]``."""
        if not isinstance(global_indices, torch.Tensor) or (
            global_indices.dim() != vocab_parallel_logits.dim()
        ):
            got = (
                tuple(global_indices.shape)
                if isinstance(global_indices, torch.Tensor)
                else type(global_indices).__name__
            )
            raise ValueError(
                f"global_indices must be [B, S, K] like the logits "
                f"{tuple(vocab_parallel_logits.shape)} ([B, S, V_local]), got {got}: for one id "
                "per position use DistributedLogprob"
            )
        return ChunkedDistributedLogprob.apply(
            vocab_parallel_logits,
            global_indices,
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only,
        )


class ChunkedDistributedEntropy:
    """Drop-in for NeMo-RL's ``ChunkedDistributedEntropy``: ``Σ_v p_v log p_v``, which is
    minus :func:`compiled_logprob.vocab_parallel_entropy`."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        chunk_size: int | None,
        tp_group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` ``Σ p log p`` (the negative entropy, as NeMo-RL returns it) of the
        full-vocabulary softmax, differentiable unless ``inference_only``."""
        if inference_only:
            vocab_parallel_logits = vocab_parallel_logits.detach()
        return -core.vocab_parallel_entropy(
            vocab_parallel_logits, group=tp_group, chunk_size=chunk_size
        )


class DistributedCrossEntropy:
    """Drop-in for NeMo-RL's ``DistributedCrossEntropy``: the soft-target cross-entropy
    ``H(p_target, q_student)`` of a distillation loss; see
    :func:`compiled_logprob.vocab_parallel_cross_entropy`. As NeMo-RL, no gradient reaches
    ``target_logits``."""

    @staticmethod
    def apply(
        student_logits: torch.Tensor,
        target_logits: torch.Tensor,
        group: dist.ProcessGroup | None,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """fp32 ``[B, S]`` ``−Σ_v p_v log q_v`` over the full vocabulary, from ``[B, S, V_local]``
        student and target logits; differentiable in the student's unless ``inference_only``."""
        if inference_only:
            student_logits = student_logits.detach()
        return core.vocab_parallel_cross_entropy(
            student_logits, target_logits.detach(), group=group
        )


__all__ += ["DistributedCrossEntropy"]


# Context parallelism, packed sequences and DTensor entry points.

__all__ += [
    "AllGatherCPTensor",
    "_get_tokens_on_this_cp_rank",
    "allgather_cp_sharded_tensor",
    "dtensor_from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "get_logprobs_from_vocab_parallel_logits",
    "get_next_token_logprobs_from_logits",
]


# Raw logits (not log-probs) over the sharded vocabulary.

__all__ += ["distributed_vocab_topk", "gather_logits_at_global_indices"]


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
    logits, start = _this_shard(vocab_parallel_logits, vocab_start_index, vocab_end_index, True)
    _validation.check_logits(logits)
    return core.vocab_parallel_topk_logits(logits, k, vocab_start=start, group=tp_group)


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
    logits, start = _this_shard(vocab_parallel_logits, vocab_start_index, vocab_end_index, False)
    _validation.check_logits(logits)
    _validation.check_token_ids(global_indices, "global_indices")
    if global_indices.dim() != 3 or global_indices.shape[0] != logits.shape[0]:
        raise ValueError(
            f"global_indices must be [B, S, K] with the logits' B, got "
            f"{tuple(global_indices.shape)} for logits {tuple(logits.shape)}"
        )
    seq_len = global_indices.shape[1]
    global_indices = context_parallel.shard_natural(global_indices, logits.shape[1], cp_group)
    picked = core.vocab_parallel_logits_at(logits, global_indices, vocab_start=start, group=tp_group)
    return context_parallel.gather_natural(picked, seq_len, cp_group)


__all__ += ["get_distillation_topk_logprobs_from_logits"]


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
        student = core.token_logprobs(
            logits, local, vocab_start=start, group=group, return_entropy=calculate_entropy
        )
        if calculate_entropy:
            student, entropy = student
            entropy = -context_parallel.gather_natural(entropy, seq_len, cp_group)[:, :-1]
        student = context_parallel.gather_natural(student, seq_len, cp_group)
    else:
        student = gather_logits_at_global_indices(
            logits, ids, group, cp_group,
            vocab_start_index=start, vocab_end_index=start + logits.shape[-1],
        ).log_softmax(-1)
    teacher = teacher_topk_logits.to(student.device, torch.float32).log_softmax(-1)
    return student[:, :-1], teacher[:, :-1], entropy


def _even_shard_start(logits: torch.Tensor, vocab_parallel_rank: int | None) -> int:
    """``vocab_parallel_rank · V_local``: where this rank's even vocabulary shard starts."""
    if vocab_parallel_rank is None:
        raise ValueError(
            "vocab_parallel_rank must be given with vocab_parallel_group: this rank's "
            "index in the vocab-parallel group, which holds vocabulary shard "
            "[rank * V_local, (rank + 1) * V_local)"
        )
    return _validation.as_int(vocab_parallel_rank, "vocab_parallel_rank", minimum=0) * logits.shape[-1]


def _student_layout(student_logits, vocab_parallel_rank, vocab_parallel_group, cp_group):
    """``(logits, vocab_start, tp_group, cp_group)`` of the three layouts that
    :func:`get_distillation_topk_logprobs_from_logits` takes."""
    if vocab_parallel_group is not None:
        start = _even_shard_start(student_logits, vocab_parallel_rank)
        return student_logits, start, vocab_parallel_group, cp_group
    if isinstance(student_logits, dtensor.DTensor):
        start, _ = dtensor.vocab_shard_bounds(student_logits)
        mesh = student_logits.device_mesh
        cp_group = mesh.get_group("cp") if "cp" in (mesh.mesh_dim_names or ()) else None
        return student_logits.to_local(), start, mesh.get_group("tp"), cp_group
    return student_logits, 0, None, cp_group


def _get_tokens_on_this_cp_rank(
    input_ids: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """CP rank ``cp_rank``'s load-balanced shard of ``input_ids`` along ``seq_dim``; see
    :func:`compiled_logprob.shard_for_context_parallel`.

    ``input_ids`` itself when ``cp_size == 1``, whatever the (int) ``cp_rank``: NeMo-RL calls
    it with ``torch.distributed.get_rank(cp_group)``, the global rank when there is no CP
    group. The sequence length must be a multiple of ``2 * cp_size`` (NeMo-RL silently drops
    the remainder: here it is a ``ValueError``).
    """
    cp_size = _validation.as_int(cp_size, "cp_size", minimum=1)
    cp_rank = _validation.as_int(cp_rank, "cp_rank")
    if cp_size == 1:
        return input_ids
    if not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"cp_rank must be in [0, cp_size = {cp_size}), got {cp_rank}: pass this rank's "
            "rank in the CP group"
        )
    return context_parallel._shard(input_ids, cp_rank, cp_size, _validation.as_int(seq_dim, "seq_dim"))


class AllGatherCPTensor:
    """Drop-in for NeMo-RL's ``AllGatherCPTensor``; see
    :func:`compiled_logprob.gather_context_parallel`."""

    @staticmethod
    def apply(
        tensor: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int = 1
    ) -> torch.Tensor:
        """All CP ranks' load-balanced shards along ``seq_dim``, gathered in natural order.

        ``cp_group=None`` is, as in NeMo-RL, torch.distributed's default (WORLD) group; when
        torch.distributed is not initialised it means no CP, and ``tensor`` is returned as it is.
        """
        if cp_group is None and dist.is_available() and dist.is_initialized():
            cp_group = dist.group.WORLD
        return context_parallel.gather_context_parallel(tensor, group=cp_group, dim=seq_dim)


def allgather_cp_sharded_tensor(
    tensor: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int = 1
) -> torch.Tensor:
    """Drop-in for NeMo-RL's function of the same name: ``AllGatherCPTensor.apply`` (so
    ``cp_group=None`` is the default group when torch.distributed is initialised)."""
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


def _sampling_filter(sampling_params: object | None) -> dict:
    """The ``top_k``/``top_p`` of ``sampling_params`` (NeMo-RL's ``TrainingSamplingParams``, or
    ``None``). Its ``temperature`` is not read, as NeMo-RL's functions here do not read it:
    their callers divide the logits by it."""
    if sampling_params is None:
        return _filter(None, 1.0)
    return _filter(getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0))


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup | None,
    inference_only: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    *,
    shift_targets: bool = True,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of ``[B, S_pad / CP, V_local]`` load-balanced
    logits and the full unshifted ``target`` ``[B, S]`` (``[B, S]``, position t scoring
    ``target[:, t]``, with ``shift_targets=False``), under ``sampling_params``' top-k/top-p
    filtering if any; see :func:`compiled_logprob.context_parallel_logprobs`."""
    vocab_parallel_logits, start = _this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    return context_parallel.context_parallel_logprobs(
        vocab_parallel_logits,
        target,
        vocab_start=start,
        group=tp_group,
        cp_group=cp_group,
        chunk_size=chunk_size,
        next_token=shift_targets,
        **_sampling_filter(sampling_params),
    )


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup | None,
    inference_only: bool = False,
    cp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    target_is_pre_rolled: bool = False,
) -> torch.Tensor:
    """fp32 ``[B, unpacked_seqlen - 1]`` next-token log-probs of a packed ``[1, T / CP, V_local]``
    row (THD layout) and its unshifted ``target`` ``[1, T]``, or with ``target_is_pre_rolled``
    this rank's ``[1, T / CP]`` targets, already rolled within each sequence and CP-sharded
    like the logits, under ``sampling_params``' top-k/top-p filtering if any; see
    :func:`compiled_logprob.packed_context_parallel_logprobs`."""
    sampling = _sampling_filter(sampling_params)
    vocab_parallel_logits, start = _this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    if not target_is_pre_rolled:
        return context_parallel.packed_context_parallel_logprobs(
            vocab_parallel_logits,
            target,
            cu_seqlens_padded,
            max_seqlen=unpacked_seqlen,
            vocab_start=start,
            group=group,
            cp_group=cp_group,
            chunk_size=chunk_size,
            **sampling,
        )
    local_fn = context_parallel._logits_logprobs(
        vocab_parallel_logits, target, vocab_start=start, group=group, chunk_size=chunk_size,
        ignore_index=None, return_entropy=False, **sampling,
    )
    return context_parallel.packed_cp_logprobs(
        local_fn,
        vocab_parallel_logits,
        target,
        cu_seqlens_padded,
        max_seqlen=unpacked_seqlen,
        cp_group=cp_group,
        temperature=1.0,
        return_entropy=False,
        next_token=True,
        name="logits",
        pre_rolled=True,
    )


def dtensor_from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup | None,
    inference_only: bool = False,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
    *,
    shift_targets: bool = True,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of local ``[B, S / CP, V_local]`` logits (``[B, S]``
    with ``shift_targets=False``); ``target`` is a tensor (no CP), or a DTensor sharded over mesh
    axis ``"cp"`` in ``seq_index`` order, under ``sampling_params``' top-k/top-p filtering if
    any; see :func:`compiled_logprob.dtensor_logprobs`."""
    vocab_parallel_logits, start = _this_shard(
        vocab_parallel_logits, vocab_start_index, vocab_end_index, inference_only
    )
    return dtensor._local_logprobs(
        vocab_parallel_logits,
        target,
        start,
        tp_group,
        seq_index,
        chunk_size,
        next_token=shift_targets,
        **_sampling_filter(sampling_params),
    )


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits: torch.Tensor,
    input_ids: torch.Tensor,
    seq_index: torch.Tensor | None = None,
    chunk_size: int | None = None,
    sampling_params: object | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of DTensor logits sharded on the vocabulary over
    mesh axis ``"tp"``, under ``sampling_params``' top-k/top-p filtering if any; see
    :func:`compiled_logprob.dtensor_logprobs`."""
    if not isinstance(vocab_parallel_logits, dtensor.DTensor):
        raise TypeError(
            f"vocab_parallel_logits must be a DTensor, got {type(vocab_parallel_logits).__name__}; "
            "use from_parallel_logits_to_logprobs for plain tensors"
        )
    names = vocab_parallel_logits.device_mesh.mesh_dim_names
    if seq_index is not None and (names is None or "cp" not in names):
        raise ValueError(
            f"seq_index is given but the logits' device mesh (axes {names}) has no 'cp' axis"
        )
    return dtensor.dtensor_logprobs(
        vocab_parallel_logits,
        input_ids,
        seq_index=seq_index,
        chunk_size=chunk_size,
        **_sampling_filter(sampling_params),
    )


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: torch.Tensor | None = None,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: dist.ProcessGroup | None = None,
    context_parallel_group: dist.ProcessGroup | None = None,
    sampling_params: object | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]`` next-token log-probs of ``input_ids`` ``[B, S]``, dispatched as NeMo-RL
    does: with ``vocab_parallel_group``, plain logits holding this rank's even vocabulary shard
    ``[vocab_parallel_rank * V_local, (vocab_parallel_rank + 1) * V_local)`` (CP over
    ``context_parallel_group``) go to :func:`from_parallel_logits_to_logprobs`; DTensor logits
    to :func:`get_logprobs_from_vocab_parallel_logits`; unsharded ``[B, S, V]`` logits to
    :func:`compiled_logprob.context_parallel_logprobs`. ``chunk_size`` bounds the eager
    temporaries on every path (NeMo-RL uses it on the first only; the values are the same).
    ``sampling_params``' top-k/top-p filtering applies on every path."""
    if vocab_parallel_group is not None:
        start = _even_shard_start(next_token_logits, vocab_parallel_rank)
        return from_parallel_logits_to_logprobs(
            next_token_logits,
            input_ids,
            start,
            start + next_token_logits.shape[-1],
            vocab_parallel_group,
            cp_group=context_parallel_group,
            chunk_size=chunk_size,
            sampling_params=sampling_params,
        )
    if isinstance(next_token_logits, dtensor.DTensor):
        return get_logprobs_from_vocab_parallel_logits(
            next_token_logits, input_ids, seq_index, chunk_size, sampling_params
        )
    return context_parallel.context_parallel_logprobs(
        next_token_logits, input_ids, chunk_size=chunk_size, **_sampling_filter(sampling_params)
    )


# NeMo-RL's small collective helpers.

__all__ += [
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
    "vocab_parallel_argmax",
    "vocab_parallel_gather_columns",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group`` (1 for ``None``, or without torch.distributed, as NeMo-RL's
    helpers treat both)."""
    if group is None or not dist.is_initialized():
        return 1
    _comm.group_name(group)  # validates it
    return group.size()


def group_all_reduce_sum_with_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``group_all_reduce_sum_with_grad``: ``Σ_ranks x``, whose gradient
    is the identity (each rank's own upstream gradient reaches its own ``x``, with no
    collective): for reductions whose every rank computes the same loss. ``x`` as it is for
    ``None``, a group of size 1 or without torch.distributed."""
    if _group_size(group) == 1:
        return x
    total = _comm.all_reduce_sum(x.detach(), group.group_name)
    return x + (total - x.detach())


def group_all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``group_all_reduce_sum``: ``Σ_ranks x`` as a constant (no
    gradient), for normalisers such as global token counts."""
    return group_all_reduce_sum_with_grad(x.detach(), group)


def vocab_parallel_argmax(
    logits: torch.Tensor, *, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_argmax``: the global id of each position's largest
    logit, int64 ``[B, S]``, of this rank's even shard ``[B, S, V_local]`` (rank r holds
    ``[r · V_local, (r + 1) · V_local)``) or of a DTensor's local shard; not differentiable.
    One all-gather of ``[B, S, 2]`` (:func:`distributed_vocab_topk` with k = 1)."""
    logits, group, start = _even_tp_shard(logits, tp_group)
    _, ids = distributed_vocab_topk(
        logits, 1, group, vocab_start_index=start, vocab_end_index=start + logits.shape[-1]
    )
    return ids.squeeze(-1)


def vocab_parallel_gather_columns(
    logits: torch.Tensor,
    column_indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``vocab_parallel_gather_columns``: the raw logits at one shared set
    of K global vocabulary ids ``column_indices`` ``[K]``, fp32 ``[B, T, K]``, from this
    rank's even shard ``[B, T, V_local]`` (or the full ``[B, T, V]`` without a group);
    differentiable, each rank's logits receiving the gradient at the ids they own. One
    all-reduce (:func:`gather_logits_at_global_indices`)."""
    if column_indices.dim() != 1:
        raise ValueError(
            f"column_indices must be [K] global ids, got shape {tuple(column_indices.shape)}"
        )
    logits, group, start = _even_tp_shard(logits, tp_group)
    ids = column_indices.to(logits.device).expand(*logits.shape[:-1], -1)
    return gather_logits_at_global_indices(
        logits, ids, group, vocab_start_index=start, vocab_end_index=start + logits.shape[-1]
    )


def _even_tp_shard(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """``(logits, group, vocab_start)`` of this rank's even vocabulary shard (a DTensor's local
    one): the group is ``None`` when it has one rank (or torch.distributed is not
    initialised), and rank r's shard starts at ``r · V_local``."""
    if isinstance(logits, dtensor.DTensor):
        logits = logits.to_local()
    if _group_size(tp_group) == 1:
        return logits, None, 0
    return logits, tp_group, tp_group.rank() * logits.shape[-1]


def all_to_all_vp2sq(
    vocab_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``all_to_all_vp2sq``: ``[BS, V_local]`` (every row, this rank's
    vocabulary slice) to ``[BS / TP, V]`` (this rank's rows, every slice; rank r gets rows
    ``[r · BS / TP, (r + 1) · BS / TP)``). One all-to-all; not differentiable."""
    size = _group_size(tp_group)
    rows, width = _check_2d(vocab_parallel_logits, "vocab_parallel_logits", size, dim=0)
    if size == 1:
        return vocab_parallel_logits
    received = _comm.all_to_all(vocab_parallel_logits, tp_group.group_name)
    # [TP · BS / TP, V_local] by source rank -> [BS / TP, TP · V_local]
    return received.view(size, rows // size, width).permute(1, 0, 2).reshape(rows // size, -1)


def all_to_all_sq2vp(
    seq_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``all_to_all_sq2vp``, the inverse of :func:`all_to_all_vp2sq`:
    ``[BS / TP, V]`` to ``[BS, V_local]``. One all-to-all; not differentiable."""
    size = _group_size(tp_group)
    rows, vocab = _check_2d(seq_parallel_logits, "seq_parallel_logits", size, dim=1)
    if size == 1:
        return seq_parallel_logits
    by_rank = seq_parallel_logits.view(rows, size, vocab // size).permute(1, 0, 2).contiguous()
    received = _comm.all_to_all(by_rank.view(-1, vocab // size), tp_group.group_name)
    return received.view(size * rows, vocab // size)


def _check_2d(tensor: torch.Tensor, name: str, size: int, *, dim: int) -> tuple[int, int]:
    """``tensor.shape`` of a 2-D tensor whose ``dim`` divides by ``size``."""
    if tensor.dim() != 2 or tensor.shape[dim] % size:
        raise ValueError(
            f"{name} must be 2-D with dim {dim} a multiple of the group size {size}, got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor.shape


def cp_load_balanced_to_contiguous(
    x: torch.Tensor, *, cp_group: dist.ProcessGroup | None = None, seq_dim: int = 1
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``cp_load_balanced_to_contiguous``: this CP rank's contiguous
    window ``[r · L, (r + 1) · L)`` of the sequence, from its load-balanced shard of ``L``
    positions; differentiable (through :func:`compiled_logprob.gather_context_parallel`)."""
    if isinstance(x, dtensor.DTensor):
        x = x.to_local()
    size = _group_size(cp_group)
    if size == 1:
        return x
    full = context_parallel.gather_context_parallel(x, group=cp_group, dim=seq_dim)
    length = x.shape[seq_dim]
    return full.narrow(seq_dim, cp_group.rank() * length, length).contiguous()


def cp_shift_next(
    x: torch.Tensor, cp_group: dist.ProcessGroup | None = None, *, fill: float
) -> torch.Tensor:
    """Drop-in for NeMo-RL's ``cp_shift_next``: ``out[:, t] = x[:, t + 1]`` over the global
    sequence of contiguous CP shards ``[B, L, ...]`` (dim 1), the last global position
    ``fill``. The next rank's first position arrives by one all-gather and carries no
    gradient back; the rest is differentiable."""
    size = _group_size(cp_group)
    following = torch.full_like(x[:, :1], fill)
    if size > 1:
        firsts = _comm.gather_ranks(x[:, :1].detach(), cp_group.group_name)
        rank = cp_group.rank()
        if rank + 1 < size:
            following = firsts[rank + 1]
    return torch.cat([x[:, 1:], following], dim=1)
