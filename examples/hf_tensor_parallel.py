"""A Hugging Face causal LM, tensor-parallel, scored by compiled_logprob in a compiled
GRPO-style step.

A small Llama (random weights from a config: nothing is downloaded) is tensor-parallelised
over 2 gloo ranks with ``parallelize_module``: the MLPs column- then row-parallel, the LM head
column-parallel with its output left vocabulary-sharded as a DTensor (V = 1003, uneven:
502 + 501). Each step's policy log-probs come from ``dtensor_logprobs`` on those logits, and
again from ``lm_head_token_logprobs`` on the final hidden states and the LM head's local
weight, with no logits at all; both are checked against the unsharded model run in float64,
and so is the LM head's gradient of the GRPO loss.

    pip install transformers   # the `examples` extra
    python examples/hf_tensor_parallel.py
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import compiled_logprob as cl

TP = 2
CONFIG = dict(
    vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)


def grpo_loss(logprobs, old_logprobs, advantages, mask):
    """The clipped policy-gradient loss of GRPO over the response tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_token * mask).sum() / mask.sum()


def from_logits(logits, input_ids):
    """Next-token log-probs ``[B, S - 1]`` from the vocabulary-sharded DTensor logits."""
    return cl.dtensor_logprobs(logits, input_ids)


def from_hidden(hidden, weight, input_ids, vocab_start, group):
    """The same from the final hidden states and this rank's LM-head rows: no logits."""
    return cl.lm_head_token_logprobs(
        hidden[:, :-1], weight, input_ids[:, 1:], vocab_start=vocab_start, group=group
    )


def rank_main(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, TP), rank=rank, world_size=TP)
    torch.manual_seed(0)  # every rank builds the same model and batch
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    reference = copy.deepcopy(model).double()  # unsharded, float64
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(CONFIG["num_hidden_layers"]):
        plan |= {
            f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(),
            f"model.layers.{i}.mlp.up_proj": ColwiseParallel(),
            f"model.layers.{i}.mlp.down_proj": RowwiseParallel(),
        }
    parallelize_module(model, mesh, plan)

    input_ids = torch.randint(0, CONFIG["vocab_size"], (2, 24))
    mask = torch.zeros(2, 23)
    mask[:, 8:] = 1.0  # the response tokens
    advantages = torch.randn(2, 1)
    compiled_logits = torch.compile(from_logits, fullgraph=True)
    compiled_hidden = torch.compile(from_hidden, fullgraph=True)

    # The unsharded float64 model's log-probs and LM-head gradient of the same loss.
    want = torch.log_softmax(reference(input_ids).logits[:, :-1], -1)
    want = want.gather(-1, input_ids[:, 1:, None])[..., 0]
    grpo_loss(want, want.detach(), advantages, mask).backward()
    want_grad = reference.lm_head.weight.grad

    weight = model.lm_head.weight  # a DTensor, rows sharded over "tp"
    rows = weight.to_local().shape[0]
    vocab_start = rank * -(-CONFIG["vocab_size"] // TP)  # torch.chunk's split: 502 + 501
    for name in ("logits", "hidden states"):
        model.zero_grad()
        if name == "logits":
            logprobs = compiled_logits(model(input_ids).logits, input_ids)
        else:
            hidden = model.model(input_ids).last_hidden_state
            logprobs = compiled_hidden(
                hidden, weight.to_local(), input_ids, vocab_start, mesh.get_group("tp")
            )
        loss = grpo_loss(logprobs, logprobs.detach(), advantages, mask)
        loss.backward()
        torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=1e-4)
        grad = weight.grad.to_local()
        torch.testing.assert_close(
            grad.double(), want_grad[vocab_start : vocab_start + rows], rtol=1e-3, atol=1e-6
        )
        if rank == 0:
            print(f"TP {TP}, from {name}: log-probs and LM-head gradient match the float64 "
                  f"model (loss {loss.item():.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"),), nprocs=TP)
