"""The main job, ``python -m compiled_logprob.demo``, at a small size.

One compiled TP=2 x CP=2 run on the shared 4-rank gloo pool (the expensive part: one cold
compile per rank), one eager packed run through the command line (exit status, progress,
table), and in-process checks of the layout helpers and of argument errors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from compiled_logprob import demo
from compiled_logprob.nemo_compat import _get_tokens_on_this_cp_rank

SMALL = ["--seq-len", "16", "--vocab", "97", "--steps", "2", "--layers", "1"]


def test_compiled_step_matches_the_float64_oracle(gloo_pool):
    options = demo.parse_args(SMALL, None)
    assert (options.tp, options.cp, options.compile, options.packed) == (2, 2, True, False)
    assert gloo_pool(4).run(demo.run_rank, options) == [True] * 4


def test_command_line_packed_eager_passes_and_prints_the_table():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "compiled_logprob.demo", *SMALL, "--packed", "--no-compile"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "step 2/2" in out and "MISMATCH" not in out
    for row in (
        "max rel. error, log-probs",
        "max rel. error, LM-head grad",
        "max rel. error, other grads",
        "step time, median after step 1",
        "collectives per fwd+bwd",
        "peak memory",
    ):
        assert row in out, out
    assert "TP=2 x CP=2 on 4 gloo processes" in out and "packed sequences" in out
    assert "PASS" in out


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
    assert "TP=1 x CP=1 on 1 gloo processes" in out and "MISMATCH" in out and "FAIL" in out


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
