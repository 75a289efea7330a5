"""The main job, ``python -m compiled_logprob.demo``, at a small size.

Two runs through the command line: one compiled TP=2 x CP=2 run (the expensive part: one
cold compile per rank) and one eager packed run; they check the exit status, that the run
says what it starts and that it compiles before going quiet, the progress, and a table of at
most 100 columns. Then in-process checks of the report, the layout helpers and argument
errors. A command-line run that outlives its timeout (scaled with the machine's load, or
``COMPILED_LOGPROB_TEST_TIMEOUT``) fails, its processes killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from compiled_logprob import _demo_cli, demo
from compiled_logprob.nemo_compat import _get_tokens_on_this_cp_rank
from compiled_logprob.testing.multiprocess import default_timeout

SMALL = ["--seq-len", "16", "--vocab", "97", "--steps", "2", "--layers", "1"]
ROWS = (
    "max rel. error, log-probs",
    "max rel. error, LM-head grad",
    "max rel. error, other grads",
    "step time, median after step 1",
    "first step",
    "collectives per fwd+bwd",
)


def run_demo(*argv: str) -> list[str]:
    """The demo's stdout lines; fails on a non-zero exit or past the (load-scaled) timeout."""
    timeout = default_timeout()
    command = [sys.executable, "-m", "compiled_logprob.demo", *argv]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # A session of its own: on a timeout, its gloo processes are killed with it.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"{' '.join(argv)}: no exit within {timeout:.0f} s\n{out}{err}")
    assert process.returncode == 0, out + err
    return out.splitlines()


def index(lines: list[str], text: str) -> int:
    """The first line holding ``text``."""
    found = [i for i, line in enumerate(lines) if text in line]
    assert found, f"no line holds {text!r}:\n" + "\n".join(lines)
    return found[0]


def mentions_compiling(lines: list[str]) -> list[str]:
    """The lines that mention compiling (the package's name aside)."""
    return [line for line in lines if "compil" in line.replace("compiled_logprob", "").lower()]


def check_report(lines: list[str], modes: list[str]) -> int:
    """The table's rows are there, with a column per mode; every line fits 100 columns.
    Returns the line of the table's header."""
    header = [i for i, line in enumerate(lines) if line.split() == modes]
    assert len(header) == 1, "\n".join(lines)
    for row in ROWS:
        assert len(lines[index(lines, row)].split()) > len(modes), row
    assert "peak memory (max RSS of one process)" in lines[index(lines, "tolerance") + 1]
    assert "PASS" in lines[-1] and not any("MISMATCH" in line for line in lines)
    too_wide = [line for line in lines if len(line) > _demo_cli.WIDTH]
    assert not too_wide, too_wide
    return header[0]


def test_command_line_compiled_says_what_it_starts_and_compiles():
    lines = run_demo(*SMALL)
    assert lines[0].startswith("compiled_logprob demo:")
    assert "TP=2 x CP=2 on 4 gloo processes" in lines[1]
    start_notice = index(lines, "compiling takes about a minute, once")
    spawn = index(lines, "starting 4 gloo processes")
    compile_notice = index(lines, "compiling forward and backward (about a minute, once)")
    table = check_report(lines, ["eager", "compiled"])
    assert start_notice < spawn < index(lines, "4 ranks up") < compile_notice < table
    assert index(lines, "step 1/2  max rel. error") > compile_notice
    assert index(lines, "step 2/2") < table
    assert "incl. compile" in lines[index(lines, "first step")]


def test_command_line_packed_eager_never_mentions_compiling():
    lines = run_demo(*SMALL, "--packed", "--no-compile")
    assert "TP=2 x CP=2 on 4 gloo processes" in lines[1] and "packed sequences" in "\n".join(lines)
    assert index(lines, "each step eager only") < index(lines, "starting 4 gloo processes")
    table = check_report(lines, ["eager"])
    assert index(lines, "step 2/2  max rel. error") < table
    assert not mentions_compiling(lines)


HUGE = ["--tp", "71", "--cp", "5", "--batch", "128", "--seq-len", "81920"]
HUGE += ["--vocab", "152064", "--hidden", "8192", "--steps", "1000", "--packed"]


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("argv", [[], SMALL, HUGE], ids=["default", "small", "huge"])
def test_report_fits_100_columns_at_any_size(argv, compile, capsys):
    options = demo.parse_args(argv if compile else [*argv, "--no-compile"], None)
    modes = ["eager", "compiled"] if compile else ["eager"]
    collectives = Counter(all_gather_into_tensor=2, reduce_scatter_tensor=1, all_to_all=12)
    demo.announce(options)
    demo.progress(1, options, [1.23e-7, 4.56e-5, 7.89e-1], ok=True)
    demo.progress(options.steps, options, [1.23e-7, 4.56e-5, 7.89e-1], ok=False)
    demo.print_report(
        options,
        modes,
        errors=[[1.234e-7, 5.6e-5, 1.0]] * len(modes),
        times=[(1234.5, 98.7654), (0.1, None)][: len(modes)],
        collectives=[collectives] * len(modes),
        peak_rss_kib=123456789,
        ok=False,
        tol=demo.tolerance(options),
    )
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= _demo_cli.WIDTH, lines
    assert f"step {options.steps}/{options.steps}" in lines[index(lines, "MISMATCH")]
    row = index(lines, "collectives per fwd+bwd")
    assert lines[row].split()[3:] == ["15"] * len(modes)
    kinds = [line.split() for line in lines[row + 1 : row + 4]]
    assert kinds == [[kind] + [str(n)] * len(modes) for kind, n in sorted(collectives.items())]
    assert lines[-1].startswith("FAIL")
    assert bool(mentions_compiling(lines)) == compile


def test_still_says_what_it_is_doing_until_done(capsys):
    with demo.still("compiling", every=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and all(line.startswith("  still compiling (") for line in lines)
    time.sleep(0.2)
    assert capsys.readouterr().out == ""  # the ticker stopped with the block


def test_still_stops_early_when_told(capsys):
    up = []

    def ticking() -> bool:
        return any(thread.name == "demo-still" for thread in threading.enumerate())

    with demo.still("starting", every=0.05, until=lambda: bool(up)):
        out, deadline = "", time.monotonic() + 30
        while not out and time.monotonic() < deadline:
            time.sleep(0.01)
            out = capsys.readouterr().out
        assert out.startswith("  still starting (") and ticking()
        up.append(True)
        while ticking() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ticking()  # the ticker ended inside the block


def test_a_mismatch_exits_non_zero_under_torchrun(monkeypatch, capsys):
    # One in-process rank, launched the torchrun way, with a tolerance nothing can meet.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(demo, "tolerance", lambda options: 0.0)
    argv = ["--seq-len", "8", "--vocab", "31", "--steps", "1", "--no-compile"]
    assert demo.main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith("compiled_logprob demo:") and "each step eager only" in out
    assert "TP=1 x CP=1 on 1 gloo process," in out and "MISMATCH" in out and "FAIL" in out


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_cp_positions_are_the_load_balanced_layout(cp_size):
    padded_lens = torch.tensor([1, 3, 2]) * 2 * cp_size
    starts = padded_lens.cumsum(0) - padded_lens
    for rank in range(cp_size):
        expected = torch.cat(
            [
                _get_tokens_on_this_cp_rank(torch.arange(start, start + n), rank, cp_size, seq_dim=0)
                for start, n in zip(starts.tolist(), padded_lens.tolist())
            ]
        )
        assert torch.equal(demo.cp_positions(padded_lens, rank, cp_size), expected)


def test_causal_mix_averages_the_prefix_within_each_sequence():
    mix = demo.causal_mix(torch.tensor([2, 3]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1 / 2, 1 / 2, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1 / 2, 1 / 2, 0],
            [0, 0, 1 / 3, 1 / 3, 1 / 3],
        ]
    )
    torch.testing.assert_close(mix, expected)


def test_packed_batch_holds_the_same_tokens_as_the_padded_one():
    options = demo.parse_args(SMALL + ["--packed"], None)
    lens = demo.padded_lengths(options)
    unit = 2 * options.cp
    assert ((lens % unit == 0) & (lens >= unit) & (lens <= options.seq_len)).all()
    shard = demo.Shard(
        tp_group=None, cp_group=None, vocab_start=0, vocab_end=options.vocab, positions=None,
        padded_lens=lens, mix=None, cu_seqlens_padded=None,
    )
    batch = demo.make_batch(0, shard, options)
    assert batch.model_ids.shape == (1, int(lens.sum()))
    unpacked = batch.model_ids[0].split(lens.tolist())
    for row, seq in zip(batch.input_ids, unpacked):
        assert torch.equal(row[: len(seq)], seq)
    # Every sequence scores at least one real token, and only inside its padded length.
    assert (batch.loss_mask.sum(-1) >= 1).all()
    assert not (batch.loss_mask.bool() & ~batch.compare_mask).any()


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--seq-len", "10"], None, "multiple of 2 * cp = 4"),
        (["--vocab", "1", "--tp", "2"], None, "every TP rank needs at least one vocabulary row"),
        (["--tp", "2", "--cp", "2"], 2, "torchrun started 2"),
        (["--steps", "0"], None, "--steps must be >= 1"),
    ],
)
def test_bad_arguments_exit_with_the_fix(argv, world_size, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv, world_size)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


MESHES = [
    ([], None, (2, 2)),
    (["--seq-len", "12"], 6, (2, 3)),
    (["--seq-len", "12"], 3, (1, 3)),
    (["--tp", "4"], 4, (4, 1)),
]


@pytest.mark.parametrize("argv, world_size, mesh", MESHES)
def test_default_mesh_fills_the_world(argv, world_size, mesh):
    options = demo.parse_args(argv, world_size)
    assert (options.tp, options.cp) == mesh
