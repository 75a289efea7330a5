"""The math of the vocab-parallel softmax, split by concern. No op registrations here but
one primitive the math itself calls: ``kernels.pointwise``, per-row ``exp``/``log`` with the
same bits at any shape (opaque to the compiler).

``kernels`` (eager vs traced ops) → ``tiles`` (the fixed reduction order) → ``stats`` and
``topk`` (one shard's statistics) → ``merge`` (every rank's statistics merged, after an
all-gather and an all-reduce of exact sums) → ``grad``
(gradients); ``filtering`` and ``cross_entropy`` are the top-k/top-p and distillation
variants; ``layout`` maps context-parallel positions.

Shape legend: ``B`` batch, ``S`` sequence positions, ``V_local`` this rank's vocabulary
slice, ``R`` ranks of the vocab-parallel group, ``K`` target ids per position, ``F``
statistics per row. The scaled logits are ``z = logits / temperature`` (``temperature``
fp32 ``[B, S]``, or ``None`` for 1); everything is over ``z``, in fp32, but ``z`` itself is
never formed: the temperature folds into the one per-row multiply every pass does anyway.
"""
