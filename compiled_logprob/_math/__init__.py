"""The math of the vocab-parallel softmax, split by concern; no op registrations here.

``kernels`` (eager vs traced ops) → ``stats`` and ``topk`` (one shard's statistics) →
``merge`` (every rank's statistics merged, after the one all-gather) → ``grad``
(gradients); ``filtering`` and ``cross_entropy`` are the top-k/top-p and distillation
variants; ``layout`` maps context-parallel positions.

Shape legend: ``B`` batch, ``S`` sequence positions, ``V_local`` this rank's vocabulary
slice, ``R`` ranks of the vocab-parallel group, ``K`` target ids per position, ``F``
statistics per row. The scaled logits are ``z = logits / temperature`` (``temperature``
fp32 ``[B, S]``, or ``None`` for 1); everything is over ``z``, in fp32, but ``z`` itself is
never formed: the temperature folds into the one per-row multiply every pass does anyway.
"""
