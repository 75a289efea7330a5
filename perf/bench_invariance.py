"""The cost of batch invariance: the tiled reduction order against one tile per row, side by
side in one process, interleaved, on this CPU.

Both variants run the same code, exact fixed-point sums and collectives included; only the
tile width differs (``TILE_WIDTH`` = 1024, the default, against tiles of 256 and one tile
as wide as the shard, which is the previous whole-row reduction). Also the floor: one compiled read of the
logits (``amax``). Token log-probs of ``[2, 2048, 32000]`` logits, forward and training
step (forward and backward), fp32 and bf16, compiled and eager.

    python perf/bench_invariance.py [--repeats 9] [--shape 2 2048 32000]

Writes ``perf/results/invariance_cpu.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import time
import types

import torch

import compiled_logprob as cl
from compiled_logprob._math import tiles

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _step(forward, logits: torch.Tensor, target: torch.Tensor, training: bool) -> torch.Tensor:
    """The forward (``forward``: token_logprobs, maybe compiled), or forward and backward."""
    if not training:
        with torch.no_grad():
            return forward(logits, target)
    logits = logits.detach().requires_grad_(True)
    forward(logits, target).sum().backward()
    return logits.grad


def _floor(logits: torch.Tensor) -> torch.Tensor:
    return logits.amax(-1)


def _forward(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return cl.token_logprobs(logits, target)


def _compiled_forward(name: str):
    """``_forward`` compiled as a function of its own: the tile width is read when Inductor
    decomposes the op, after Dynamo's guards, so each width needs its own code object (its
    own cache entry) and no FX graph cache."""
    code = _forward.__code__.replace(co_name=f"forward_{name.replace(' ', '_')}")
    return torch.compile(types.FunctionType(code, globals()), fullgraph=True)


def _measure(shape, dtype, repeats: int) -> list[tuple[str, float, float, float, float]]:
    """``(mode, floor, tiled, tiles of 256, one tile)`` median milliseconds per (mode, step)."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    widths = {"tiled": tiles.TILE_WIDTH, "256": 256, "one tile": shape[-1]}
    rows = []
    for compiled in (True, False):
        for training in (False, True):
            torch._dynamo.reset()
            floor = torch.compile(_floor) if compiled else _floor
            calls = {"floor": (tiles.TILE_WIDTH, lambda: floor(logits))}
            for name, width in widths.items():
                forward = _compiled_forward(name) if compiled else _forward
                calls[name] = (width, lambda f=forward: _step(f, logits, target, training))
            times: dict[str, list[float]] = {name: [] for name in calls}
            for i in range(repeats + 2):
                for name, (width, call) in calls.items():
                    tiles.TILE_WIDTH = width  # read at trace time: each variant its own graph
                    begin = time.perf_counter()
                    call()
                    if i >= 2:  # the first two calls compile and warm up
                        times[name].append(time.perf_counter() - begin)
            tiles.TILE_WIDTH = widths["tiled"]
            mode = f"{'compiled' if compiled else 'eager'} {'training' if training else 'forward'}"
            rows.append((mode, *(statistics.median(times[n]) * 1e3 for n in calls)))
    return rows


def main() -> None:
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 2048, 32000])
    args = parser.parse_args()
    lines = [
        "# Cost of batch invariance (tiles of 1024 ids against one tile per row)",
        "",
        f"`token_logprobs` of `{args.shape}` logits, TP = 1, median of {args.repeats} "
        f"interleaved calls each; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. The floor is one "
        "compiled (or eager) `amax` over the logits.",
        "",
        "| dtype | mode | floor (ms) | tiled (ms) | tiles of 256 (ms) | one tile (ms) "
        "| tiled / one tile | 256 / one tile | tiled / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dtype in DTYPES.items():
        for mode, floor, tiled, narrow, whole in _measure(args.shape, dtype, args.repeats):
            lines.append(
                f"| {name} | {mode} | {floor:.1f} | {tiled:.1f} | {narrow:.1f} | {whole:.1f} | "
                f"{tiled / whole:.2f}× | {narrow / whole:.2f}× | {tiled / floor:.2f}× |"
            )
            print(lines[-1], flush=True)
    out = pathlib.Path(__file__).parent / "results" / "invariance_cpu.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
