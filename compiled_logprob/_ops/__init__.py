"""The custom ops: one module per op family, each op's schema, fake, autograd and
Inductor decomposition readable top to bottom. Importing this package registers them all.

Eager, an op walks the sequence in blocks (``blocks``) so that no temporary outgrows one;
under Inductor it decomposes into the loop-free math of ``compiled_logprob._math``, one
fused pass over the logits that keeps no ``[B, S, V_local]`` temporary at all. The
hidden-state ops stay opaque to the compiler instead: their loop over logits tiles must
not unroll into the graph.
"""

from compiled_logprob._ops import (
    cross_entropy,
    filtering,
    lm_head,
    lm_head_cross_entropy,
    lm_head_filtered,
    stats,
)

__all__ = [
    "cross_entropy",
    "filtering",
    "lm_head",
    "lm_head_cross_entropy",
    "lm_head_filtered",
    "stats",
]
