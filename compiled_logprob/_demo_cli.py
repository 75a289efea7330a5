"""The demo's command line (:class:`Options`, :func:`parse_args`) and everything it says:
lines of at most :data:`WIDTH` columns, the announcement before anything slow, the
"still ..." ticker, a progress line per step and the report table (:mod:`compiled_logprob.demo`
runs the job).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import threading
import time
from collections import Counter

from compiled_logprob.testing.reference import vocab_bounds

DESCRIPTION = (
    "The main job: a GRPO policy-gradient step on TP×CP-sharded logits, compiled whole and "
    "checked against a float64 single-process oracle."
)
WIDTH = 100  # columns of every line the demo prints, so it reads in any terminal or log
TICK = 15.0  # seconds between "still compiling" lines: a long silence looks like a hang


@dataclasses.dataclass(frozen=True)
class Options:
    """One run's configuration, from the command line (:func:`parse_args`)."""

    tp: int
    cp: int
    batch: int
    seq_len: int
    vocab: int
    hidden: int
    layers: int
    steps: int
    packed: bool
    compile: bool
    seed: int
    lr: float


def parse_args(argv: list[str] | None, world_size: int | None) -> Options:
    """``world_size``: set when launched by torchrun, which then fixes TP × CP."""
    parser = argparse.ArgumentParser(
        prog="python -m compiled_logprob.demo", description=DESCRIPTION
    )
    add = parser.add_argument
    add("--tp", type=int, help="tensor-parallel (vocabulary) ranks (default 2)")
    add("--cp", type=int, help="context-parallel (sequence) ranks (default 2; torchrun: N / tp)")
    add("--batch", type=int, default=4, help="sequences per step (default 4)")
    add("--seq-len", type=int, default=64, help="padded length, a multiple of 2 * cp (default 64)")
    add("--vocab", type=int, default=1003, help="vocabulary; tp need not divide it (default 1003)")
    add("--hidden", type=int, default=32, help="model width (default 32)")
    add("--layers", type=int, default=2, help="causal mixing blocks (default 2)")
    add("--steps", type=int, default=5, help="training steps (default 5)")
    add("--packed", action="store_true", help="pack the sequences into one row (THD layout)")
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the step under torch.compile(fullgraph=True) (default on)",
    )
    add("--seed", type=int, default=0)
    add("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    args = parser.parse_args(argv)

    tp = args.tp if args.tp is not None else 2 if world_size is None or world_size % 2 == 0 else 1
    cp = args.cp if args.cp is not None else 2 if world_size is None else max(1, world_size // tp)
    sizes = {"tp": tp, "cp": cp, "batch": args.batch, "hidden": args.hidden}
    for name, value in {**sizes, "layers": args.layers, "steps": args.steps}.items():
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if world_size is not None and tp * cp != world_size:
        parser.error(
            f"--tp {tp} x --cp {cp} = {tp * cp} ranks, but torchrun started {world_size}: "
            f"make tp * cp = {world_size}"
        )
    if args.vocab < tp:
        parser.error(
            f"--vocab {args.vocab} is smaller than --tp {tp}: every TP rank needs at least one "
            "vocabulary row"
        )
    unit = 2 * cp
    if args.seq_len < unit or args.seq_len % unit:
        parser.error(
            f"--seq-len {args.seq_len} must be a positive multiple of 2 * cp = {unit} (each CP "
            f"rank holds 2 equal chunks of every sequence); try --seq-len "
            f"{max(1, round(args.seq_len / unit)) * unit}"
        )
    return Options(
        tp=tp,
        cp=cp,
        batch=args.batch,
        seq_len=args.seq_len,
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        steps=args.steps,
        packed=args.packed,
        compile=args.compile,
        seed=args.seed,
        lr=args.lr,
    )


def say(line: str = "") -> None:
    """Print now: spawned ranks and pipes buffer their output otherwise."""
    print(line, flush=True)


def fit(parts: list[str], margin: str = "") -> list[str]:
    """``parts`` joined by ", " into lines of at most :data:`WIDTH` columns that start with
    ``margin`` (indented once more after the first), never cut inside a part."""
    indent = margin + "  "
    lines = [margin + parts[0]]
    for i, part in enumerate(parts[1:], 2):
        comma = 1 if i < len(parts) else 0  # room for the comma that may end the line
        if len(lines[-1]) + 2 + len(part) + comma <= WIDTH:
            lines[-1] += ", " + part
        else:
            lines[-1] += ","
            lines.append(indent + part)
    return lines


def plural(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else suffix}"


def describe(options: Options, margin: str = "") -> list[str]:
    """The run's layout and sizes, e.g. ``TP=2 x CP=2 on 4 gloo processes, B=4 S=64 ...``."""
    bounds = [vocab_bounds(options.vocab, options.tp, rank) for rank in range(options.tp)]
    sizes = [end - start for start, end in bounds]
    if len(sizes) <= 4:
        shards = "/".join(map(str, sizes))
    else:  # e.g. "3 x 21724 + 4 x 21723"
        shards = " + ".join(f"{n} x {size}" for size, n in Counter(sizes).items())
    world = options.tp * options.cp
    return fit(
        [
            f"TP={options.tp} x CP={options.cp} on {plural(world, 'gloo process', 'es')}",
            f"B={options.batch} S={options.seq_len} V={options.vocab} (TP shards {shards})",
            f"hidden {options.hidden}",
            plural(options.layers, "layer"),
            plural(options.steps, "step"),
            f"{'packed' if options.packed else 'padded'} sequences",
        ],
        margin,
    )


def announce(options: Options) -> None:
    """What the run does and how long its slow part takes, before anything slow starts."""
    say("compiled_logprob demo: GRPO steps on sharded logits, checked against a float64 oracle")
    for line in describe(options, margin="  "):
        say(line)
    if options.compile:
        say("  each step eager, then under torch.compile(fullgraph=True);")
        say(
            "  compiling takes about a minute, once, in step 1 "
            "(more on a busy machine, less cached)"
        )
    else:
        say("  each step eager only")


@contextlib.contextmanager
def still(doing: str, every: float = TICK, until=None):
    """Say ``  still <doing> (N s)`` every ``every`` seconds until the block ends (or, given,
    until ``until()`` is true)."""
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        while not done.wait(every) and not (until is not None and until()):
            say(f"  still {doing} ({time.perf_counter() - start:.0f} s)")

    ticker = threading.Thread(target=tick, name="demo-still", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def progress(step: int, options: Options, errors: list[float], ok: bool) -> None:
    line = (
        f"step {step}/{options.steps}  max rel. error: log-probs {errors[0]:.1e}, "
        f"head grad {errors[1]:.1e}, other grads {errors[2]:.1e}  {'ok' if ok else 'MISMATCH'}"
    )
    if sys.stdout.isatty():  # one line, rewritten; a mismatch stays on screen
        last = step == options.steps or not ok
        print("\r" + line, end="\n" if last else "", flush=True)
    else:
        say(line)


def median_ms(seconds: float | None) -> str:
    return "n/a (one step)" if seconds is None else f"{seconds * 1e3:.1f} ms"


def print_report(options, modes, errors, times, collectives, peak_rss_kib, ok, *, tol) -> None:
    """The table, a column per mode, with the oracle's tolerance ``tol``; each line at most
    :data:`WIDTH` columns."""
    first = [
        f"{t[0]:.2f} s" + (" incl. compile" if mode == "compiled" else "")
        for mode, t in zip(modes, times)
    ]
    rows = [
        ("max rel. error, log-probs", [f"{e[0]:.2e}" for e in errors]),
        ("max rel. error, LM-head grad", [f"{e[1]:.2e}" for e in errors]),
        ("max rel. error, other grads", [f"{e[2]:.2e}" for e in errors]),
        ("step time, median after step 1", [median_ms(t[1]) for t in times]),
        ("first step", first),
        ("collectives per fwd+bwd", [str(sum(c.values())) for c in collectives]),
    ]
    for kind in sorted(set().union(*collectives)):
        rows.append((f"  {kind}", [str(c[kind]) for c in collectives]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(mode), *(len(v[i]) for _, v in rows)) for i, mode in enumerate(modes)]
    header = " " * label_width + "".join(f"  {mode:<{w}}" for mode, w in zip(modes, widths))
    say()
    for line in describe(options):
        say(line)
    say(header.rstrip())
    say("-" * len(header))
    for label, values in rows:
        cells = "".join(f"  {v:<{w}}" for v, w in zip(values, widths))
        say(f"{label:<{label_width}}{cells}".rstrip())
    say(f"tolerance (fp32 vs float64 oracle): {tol:.2e}")
    say(f"peak memory (max RSS of one process): {peak_rss_kib / 1024:.0f} MiB")
    if ok:
        say("PASS: sharded log-probs and gradients match the float64 oracle")
    else:
        say(f"FAIL: an error above exceeds the tolerance {tol:.2e}")
