"""Trainer and sampler agree to the bit: true on-policy log-probs.

The trainer scores two packed sequences sharded over TP = 2 x CP = 2 gloo ranks, in
chunks; the sampler scores each sequence alone, one token at a time, on the full logits
(TP = 1), as an inference engine's sampler would. Every log-prob is the same bits, so the
probability ratio of the first policy-gradient step is exactly 1.

    python examples/on_policy.py
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import compiled_logprob as cl

VOCAB = 4096  # two TP shards of two whole 1024-id tiles each
BOUNDS = [(0, 8), (8, 16)]  # the packed sequences: lengths multiples of 2 * CP


def full_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for the packed row, ``[16, V]`` bf16, and its token ids ``[16]``."""
    gen = torch.Generator().manual_seed(0)
    return (3 * torch.randn(16, VOCAB, generator=gen)).bfloat16(), torch.randint(
        0, VOCAB, (16,), generator=gen
    )


def trainer(rank: int, store_path: str) -> None:
    store = dist.FileStore(store_path, 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    tp = mesh.get_local_rank("tp")
    logits, ids = full_logits()
    # This rank's part: each sequence load-balanced over CP on its own, its vocabulary slice.
    start = tp * VOCAB // 2
    local = torch.cat([
        cl.shard_for_context_parallel(logits[s:e], group=mesh.get_group("cp"), dim=0)
        for s, e in BOUNDS
    ])[None, :, start : start + VOCAB // 2]
    cu = torch.tensor([0, *(e for _, e in BOUNDS)])
    logprobs = cl.packed_context_parallel_logprobs(
        local, ids[None], cu, max_seqlen=8, vocab_start=start,
        group=mesh.get_group("tp"), cp_group=mesh.get_group("cp"), chunk_size=2,
    )
    if rank == 0:
        for i, (s, e) in enumerate(BOUNDS):
            # The sampler: one token at a time, full logits, no process group.
            sampled = torch.cat([
                cl.sampler_logprobs(logits[t : t + 1], ids[t + 1 : t + 2]) for t in range(s, e - 1)
            ])
            assert torch.equal(logprobs[i, : e - s - 1], sampled), "trainer and sampler differ"
        print(f"trainer (TP 2 x CP 2, packed, chunked) == sampler (TP 1, token by token): "
              f"{sum(e - s - 1 for s, e in BOUNDS)} log-probs, bit for bit")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(trainer, args=(os.path.join(folder, "store"),), nprocs=4)
