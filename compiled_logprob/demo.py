"""The main job: a GRPO policy-gradient step on TP×CP-sharded logits, compiled whole and
checked against a float64 single-process oracle.

::

    python -m compiled_logprob.demo                        # 4 CPU gloo processes: TP=2 x CP=2
    python -m compiled_logprob.demo --packed --steps 3     # packed (THD) sequences
    torchrun --nproc-per-node 4 -m compiled_logprob.demo   # the same ranks under torchrun

Every rank builds the same tiny causal LM (embedding, causal token-mixing MLP blocks, a
vocab-parallel LM head: TP rank t holds rows ``[vocab_start, vocab_end)`` of the head, an
uneven split when TP does not divide the vocabulary). A step computes the hidden states of
the whole batch on every rank (the model is tiny; the point is the log-prob path), keeps this
rank's load-balanced CP shard of the positions, projects it on this rank's vocabulary slice
(logits ``[B, S / CP, V_local]``, or ``[1, T / CP, V_local]`` packed) and takes next-token
log-probs with NeMo-RL's ``from_parallel_logits_to_logprobs`` (this package's drop-in),
then a GRPO loss. Forward and loss are one ``torch.compile(fullgraph=True)`` graph; the
backward is its compiled backward graph. Every step the log-probs and the gradients of every
parameter are checked against the same model run in float64 on the full vocabulary and
sequence in one process; the exit status is 1 on a mismatch.

It talks while it works, in lines of at most 100 columns: before spawning, the configuration
(and, when compiling, that the compile takes about a minute, once); then rank 0 a line per
phase (ranks up, step 1's oracle and eager step, the compile, with a "still compiling" line
every 15 s) and a progress line per step; then a table, a column per mode (eager, compiled):
the largest errors, the median step time (forward and backward), the first step's time (the
compile's, for the compiled column), the collectives one forward and backward launches; and
the peak memory (max RSS) of a process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from compiled_logprob._demo_cli import (
    Options,
    announce,
    parse_args,
    plural,
    print_report,
    progress,
    say,
    still,
)
from compiled_logprob.nemo_compat import (
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
)
from compiled_logprob.testing.multiprocess import GlooPool, WorkerError
from compiled_logprob.testing.reference import oracle_logprobs, vocab_bounds

PAD_ID = 0
CLIP = 0.2  # PPO/GRPO ratio clipping


# ----------------------------------------------------------------------------- model


class TinyCausalLM(nn.Module):
    """Embedding, ``layers`` causal token-mixing MLP blocks and a vocab-parallel LM head.

    ``forward`` gives the final hidden states ``[B, S, D]``; a block adds
    ``mlp(mix @ x)``, where ``mix`` ``[S, S]`` averages each position's causal prefix (within its
    own sequence when packed). ``head`` ``[V_local, D]`` holds this rank's rows of the LM
    head (all ``V`` rows until :meth:`shard_head`).
    """

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Parameter(torch.randn(vocab, hidden) / math.sqrt(hidden))

    def shard_head(self, vocab_start: int, vocab_end: int) -> None:
        self.head = nn.Parameter(self.head.detach()[vocab_start:vocab_end].clone())

    def forward(self, input_ids: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(mix @ x)
        return x


# ----------------------------------------------------------------------------- layout and data


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where this rank sits: its groups, vocabulary slice and sequence positions."""

    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    vocab_start: int
    vocab_end: int
    positions: torch.Tensor  # [S / CP] (or [T / CP] packed): this CP rank's positions, ascending
    padded_lens: torch.Tensor  # [B] padded length of each sequence (all S unless packed)
    mix: torch.Tensor  # [S, S] (or [T, T]) the model's causal prefix average
    cu_seqlens_padded: torch.Tensor | None  # [B + 1] when packed


@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S] every sequence from column 0, PAD_ID after its end
    model_ids: torch.Tensor  # what the sharded model reads: input_ids, or packed [1, T]
    advantages: torch.Tensor  # [B, 1] group-relative
    loss_mask: torch.Tensor  # [B, S - 1] 1.0 where the predicted token is a real one
    compare_mask: torch.Tensor  # [B, S - 1] True inside the padded sequence (a log-prob exists)


def padded_lengths(options: Options) -> torch.Tensor:
    """``[B]``: all ``S``, or (packed) fixed random multiples of ``2 * CP`` in ``[2 * CP, S]``."""
    if not options.packed:
        return torch.full((options.batch,), options.seq_len)
    unit = 2 * options.cp
    generator = torch.Generator().manual_seed(options.seed)
    units = torch.randint(1, options.seq_len // unit + 1, (options.batch,), generator=generator)
    return units * unit


def cp_positions(padded_lens: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's positions of the row holding the sequences ``padded_lens`` back to back.

    Each sequence is cut into ``2 * CP`` equal chunks; rank r holds chunks r and
    ``2 * CP - 1 - r``, which in ascending order is exactly its load-balanced buffer.
    """
    seq = torch.repeat_interleave(torch.arange(len(padded_lens)), padded_lens)
    start = (padded_lens.cumsum(0) - padded_lens)[seq]
    chunk = (torch.arange(len(seq)) - start) // (padded_lens[seq] // (2 * cp_size))
    owner = torch.minimum(chunk, 2 * cp_size - 1 - chunk)
    return (owner == cp_rank).nonzero().squeeze(-1)


def causal_mix(padded_lens: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` (``N = sum(padded_lens)``): row t averages positions ``<= t`` of t's own
    sequence, for the sequences ``padded_lens`` back to back."""
    seq = torch.repeat_interleave(torch.arange(len(padded_lens)), padded_lens)
    visible = (seq.unsqueeze(0) == seq.unsqueeze(1)).tril().float()
    return visible / visible.sum(-1, keepdim=True)


def make_batch(step: int, shard: Shard, options: Options) -> Batch:
    """The same random batch on every rank: tokens, real lengths within the padded ones, rewards."""
    generator = torch.Generator().manual_seed(options.seed + 1 + step)
    batch, seq_len = options.batch, options.seq_len
    lens = shard.padded_lens
    shortest = lens // 2 + 1  # at least 2 tokens, so every sequence has a loss term
    real = shortest + (torch.rand(batch, generator=generator) * (lens - shortest + 1)).long()
    column = torch.arange(seq_len)
    tokens = torch.randint(options.vocab, (batch, seq_len), generator=generator)
    input_ids = torch.where(column < real.unsqueeze(-1), tokens, PAD_ID)
    rewards = torch.randn(batch, generator=generator)
    advantages = (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6)
    model_ids = input_ids[column < lens.unsqueeze(-1)].unsqueeze(0) if options.packed else input_ids
    return Batch(
        input_ids=input_ids,
        model_ids=model_ids,
        advantages=advantages.unsqueeze(-1),
        loss_mask=(column[1:] < real.unsqueeze(-1)).float(),
        compare_mask=column[:-1] < (lens - 1).unsqueeze(-1),
    )


# ----------------------------------------------------------------------------- the step


def grpo_loss(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Clipped-ratio policy-gradient loss, mean over real tokens; the same on every rank.

    The rollout policy is the current one (an on-policy step), so the ratio is 1 in value
    and ``exp(logprobs - logprobs.detach())`` only carries the gradient.
    """
    ratio = torch.exp(logprobs - logprobs.detach())
    clipped = ratio.clamp(1 - CLIP, 1 + CLIP)
    surrogate = torch.minimum(ratio * batch.advantages, clipped * batch.advantages)
    return -(surrogate * batch.loss_mask).sum() / batch.loss_mask.sum()


def sharded_policy_loss(
    model: TinyCausalLM, batch: Batch, shard: Shard
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logprobs [B, S - 1])`` from TP×CP-sharded logits; compiled whole."""
    hidden = model(batch.model_ids, shard.mix).index_select(1, shard.positions)
    logits = hidden @ model.head.T  # [B, S / CP, V_local] or [1, T / CP, V_local]
    bounds = (shard.vocab_start, shard.vocab_end)
    if shard.cu_seqlens_padded is None:
        logprobs = from_parallel_logits_to_logprobs(
            logits, batch.model_ids, *bounds, shard.tp_group, cp_group=shard.cp_group
        )
    else:
        logprobs = from_parallel_logits_to_logprobs_packed_sequences(
            logits,
            batch.model_ids,
            shard.cu_seqlens_padded,
            batch.input_ids.shape[1],
            *bounds,
            shard.tp_group,
            cp_group=shard.cp_group,
        )
    return grpo_loss(logprobs, batch), logprobs.detach()


def oracle_policy_loss(
    model: TinyCausalLM, params: dict[str, torch.Tensor], batch: Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss in float64 on the full vocabulary and unpacked sequences, one process."""
    mix = causal_mix(torch.tensor(batch.input_ids.shape[1:])).double()
    hidden = torch.func.functional_call(model, params, (batch.input_ids, mix))
    logits = hidden @ params["head"].T
    logprobs = oracle_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    return grpo_loss(logprobs, batch), logprobs.detach()


def gradient_step(loss_fn, model, batch, shard):
    """``(logprobs, gradients, seconds)`` of one forward and backward."""
    start = time.perf_counter()
    loss, logprobs = loss_fn(model, batch, shard)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return logprobs, grads, time.perf_counter() - start


def synced_grads(model: TinyCausalLM, grads, shard: Shard, cp_size: int) -> dict[str, torch.Tensor]:
    """Each rank's gradients turned into the true gradient of its parameters.

    Every rank computes the whole loss, and the CP gather's backward sums the CP ranks'
    (identical) upstream gradients, so a rank's gradient is CP times its positions' share:
    the head sums over CP and divides by CP. The replicated body also sums over TP, whose
    ranks each back-propagate their vocabulary slice only.
    """
    synced = {}
    for (name, _), grad in zip(model.named_parameters(), grads):
        total = grad.detach().clone()
        dist.all_reduce(total, group=shard.cp_group if name == "head" else None)
        synced[name] = total / cp_size
    return synced


def full_head(model: TinyCausalLM, options: Options, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """All TP ranks' head rows, ``[V, D]`` (shards may be uneven: pad, gather, trim)."""
    rows = -(-options.vocab // options.tp)
    padded = F.pad(model.head.detach(), (0, 0, 0, rows - model.head.shape[0]))
    gathered = [torch.empty_like(padded) for _ in range(options.tp)]
    dist.all_gather(gathered, padded, group=tp_group)  # the same on torch 2.12 and 2.13
    bounds = [vocab_bounds(options.vocab, options.tp, rank) for rank in range(options.tp)]
    return torch.cat([rows[: end - start] for rows, (start, end) in zip(gathered, bounds)])


def oracle(model: TinyCausalLM, batch: Batch, options: Options, shard: Shard):
    """``(logprobs, gradients)`` of the float64 oracle at the current parameters, the head's
    gradient sliced to this rank's rows."""
    params = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
    params["head"] = full_head(model, options, shard.tp_group).double().requires_grad_()
    loss, logprobs = oracle_policy_loss(model, params, batch)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    grads["head"] = grads["head"][shard.vocab_start : shard.vocab_end]
    return logprobs, grads


# ----------------------------------------------------------------------------- checks and reports


def tolerance(options: Options) -> float:
    """Largest allowed ``max |fp32 - fp64| / max |fp64|`` of a log-prob or gradient tensor.

    Each value comes out of a chain of fp32 reductions no longer than
    ``K = max(2 * hidden, vocab, seq_len)``, whose rounding error grows like ``sqrt(K) * eps``;
    the chain has three steps per block (mixing, two linears) and a few for the embedding,
    head, softmax and loss, and each may amplify the error by a small factor (2 here).
    """
    reduction = max(2 * options.hidden, options.vocab, options.seq_len)
    depth = 3 * options.layers + 4
    return 2 * depth * math.sqrt(reduction) * torch.finfo(torch.float32).eps


def relative_error(
    actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None
) -> float:
    """``max |actual - expected| / max |expected|`` (where ``mask``)."""
    if mask is not None:
        actual, expected = actual * mask, expected * mask
    scale = expected.abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    return ((actual.double() - expected).abs().max() / scale).item()


def step_errors(logprobs, grads, reference) -> list[float]:
    """``[log-probs, LM head, other parameters]`` relative errors against the oracle."""
    ref_logprobs, ref_grads, compare_mask = reference
    others = [relative_error(grads[name], ref_grads[name]) for name in grads if name != "head"]
    return [
        relative_error(logprobs, ref_logprobs, compare_mask),
        relative_error(grads["head"], ref_grads["head"]),
        max(others),
    ]


def world_max(values: list[float]) -> list[float]:
    maxima = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return maxima.tolist()


@contextlib.contextmanager
def stderr_to_devnull():
    """The CPU profiler's backend logs its start and stop on fd 2, with no switch to turn it off."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def count_collectives(loss_fn, model, batch, shard) -> Counter:
    """Collectives one forward and backward launches, by kind, from the profiler's op events."""
    skip = ("wait_tensor", "_wrap_tensor_autograd")
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with stderr_to_devnull(), torch.profiler.profile(activities=cpu) as prof:
        gradient_step(loss_fn, model, batch, shard)
    names = [event.name for event in prof.events()]
    kinds = [name.split("::")[1] for name in names if name.startswith("_c10d_functional::")]
    return Counter(kind for kind in kinds if kind not in skip)


# ----------------------------------------------------------------------------- ranks and launch


def make_shard(options: Options) -> Shard:
    mesh = init_device_mesh("cpu", (options.cp, options.tp), mesh_dim_names=("cp", "tp"))
    tp_group, cp_group = mesh.get_group("tp"), mesh.get_group("cp")
    padded_lens = padded_lengths(options)
    row_lens = padded_lens if options.packed else padded_lens[:1]
    vocab_start, vocab_end = vocab_bounds(options.vocab, options.tp, tp_group.rank())
    cu_seqlens = F.pad(padded_lens.cumsum(0), (1, 0)) if options.packed else None
    return Shard(
        tp_group=tp_group,
        cp_group=cp_group,
        vocab_start=vocab_start,
        vocab_end=vocab_end,
        positions=cp_positions(row_lens, cp_group.rank(), options.cp),
        padded_lens=padded_lens,
        mix=causal_mix(row_lens),
        cu_seqlens_padded=cu_seqlens,
    )


def run_rank(options: Options, launched: float | None = None, up: str | None = None) -> bool:
    """One rank's whole run; every rank returns the same verdict. Rank 0 reports progress;
    ``launched``: the launch's ``time.time()``, to say how long the ranks took to come up;
    ``up``: a file rank 0 creates then, which stops the launcher's "still starting" lines."""
    torch.set_num_threads(1)
    shard = make_shard(options)
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        if up is not None:
            open(up, "w").close()
        since = "" if launched is None else f" after {time.time() - launched:.1f} s"
        say(f"{plural(dist.get_world_size(), 'rank')} up{since}")
    torch.manual_seed(options.seed)
    model = TinyCausalLM(options.vocab, options.hidden, options.layers)
    model.shard_head(shard.vocab_start, shard.vocab_end)
    loss_fns = {"eager": sharded_policy_loss}
    if options.compile:
        loss_fns["compiled"] = torch.compile(sharded_policy_loss, fullgraph=True)
    tol = tolerance(options)
    worst = {mode: [0.0, 0.0, 0.0] for mode in loss_fns}
    seconds: dict[str, list[float]] = {mode: [] for mode in loss_fns}
    ok = True
    for step in range(options.steps):
        first = is_rank0 and step == 0
        if first:
            say(f"step 1/{options.steps}: float64 oracle and eager step...")
        batch = make_batch(step, shard, options)
        ref_logprobs, ref_grads = oracle(model, batch, options, shard)
        reference = (ref_logprobs, ref_grads, batch.compare_mask)
        step_worst = [0.0, 0.0, 0.0]
        for mode, loss_fn in loss_fns.items():
            compiling = first and mode == "compiled"
            if compiling:
                say(
                    f"step 1/{options.steps}: compiling forward and backward "
                    "(about a minute, once)..."
                )
            with still("compiling") if compiling else contextlib.nullcontext():
                logprobs, grads, elapsed = gradient_step(loss_fn, model, batch, shard)
            synced = synced_grads(model, grads, shard, options.cp)
            errors = world_max(step_errors(logprobs, synced, reference))
            worst[mode] = [max(a, b) for a, b in zip(worst[mode], errors)]
            step_worst = [max(a, b) for a, b in zip(step_worst, errors)]
            seconds[mode].append(elapsed)
        step_ok = max(step_worst) <= tol
        ok = ok and step_ok
        with torch.no_grad():  # SGD with the gradients of the last mode run
            for name, param in model.named_parameters():
                param.sub_(options.lr * synced[name])
        if is_rank0:
            progress(step + 1, options, step_worst, step_ok)

    collectives = [count_collectives(fn, model, batch, shard) for fn in loss_fns.values()]
    times = []
    for mode in loss_fns:
        slowest = world_max(seconds[mode])  # a step takes as long as its slowest rank
        times.append((slowest[0], statistics.median(slowest[1:]) if len(slowest) > 1 else None))
    (peak_rss,) = world_max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss])
    if is_rank0:
        print_report(
            options, list(worst), list(worst.values()), times, collectives, peak_rss, ok,
            tol=tolerance(options),
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every check passes, 1 on a mismatch."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    options = parse_args(argv, int(os.environ["WORLD_SIZE"]) if torchrun else None)
    if torchrun:
        if os.environ["RANK"] == "0":
            announce(options)
        dist.init_process_group("gloo")
        try:
            return 0 if run_rank(options) else 1
        finally:
            dist.destroy_process_group()
    announce(options)
    world = options.tp * options.cp
    processes = plural(world, "gloo process", "es")
    say(f"starting {processes} (they import torch: 5-30 s, more on a busy machine)...")
    launched = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="compiled_logprob_demo_") as scratch:
            up = os.path.join(scratch, "up")
            with GlooPool(world, timeout=3600.0) as pool:
                with still("starting the processes", until=lambda: os.path.exists(up)):
                    return 0 if all(pool.run(run_rank, options, launched, up)) else 1
    except WorkerError as error:
        print(error, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
