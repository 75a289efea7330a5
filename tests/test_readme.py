"""README.md's python blocks, run as a reader would run them, so that the README cannot rot.

Every ```python block of README.md is one of two kinds, and each is run:

* a **torchrun** block, whose first line is ``# torchrun --nproc-per-node N example.py``:
  written to that file and run on ``N`` CPU ranks (gloo) by
  ``python -m torch.distributed.run --nproc-per-node N --master-port <free port>``;
* a **single-process** block, any other: run by ``python -c``.

A block that starts ranks (``init_device_mesh``, ``init_process_group``) without the torchrun
line is neither, and fails. The examples check their own results (``assert_close`` against
torch's own log-softmax), so a zero exit status is the pass. They import the
``compiled_logprob`` that this test imports, whatever the working directory.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import compiled_logprob

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 600  # generous: four ranks importing torch on two busy cores take ~10 s
TORCHRUN = re.compile(r"# torchrun --nproc-per-node (\d+) (\w+\.py)\s*")
STARTS_RANKS = re.compile(r"\b(init_device_mesh|init_process_group)\b")


def _python_blocks() -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block of README.md (``line``: its first code line)."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if code is None and line.strip() == "```python":
            code, start = [], number + 1
        elif code is not None and line.strip() == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    assert code is None, f"README.md: the ```python block at line {start} is never closed"
    return blocks


BLOCKS = _python_blocks()


def _kind(code: str) -> str:
    return "torchrun" if TORCHRUN.fullmatch(code.splitlines()[0]) else "single-process"


def _env() -> dict[str, str]:
    package_root = str(Path(compiled_logprob.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str], cwd: Path, where: str) -> None:
    """Runs ``command`` in its own session (so that a timeout ends every rank it spawned) and
    fails with its output unless it exits with 0 within ``TIMEOUT_S``."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{where} ran over {TIMEOUT_S} s; its output:\n{output[-20000:]}")
    if process.returncode != 0:
        pytest.fail(f"{where} exited with {process.returncode}; its output:\n{output[-20000:]}")


def test_readme_has_both_kinds_of_example():
    kinds = [_kind(code) for _, code in BLOCKS]
    assert "single-process" in kinds and "torchrun" in kinds, (
        f"README.md's python blocks are {kinds}: the single-process example or the torchrun "
        "one (first line '# torchrun --nproc-per-node N example.py') has gone"
    )


@pytest.mark.parametrize(
    "line, code", BLOCKS, ids=[f"README.md:{line}-{_kind(code)}" for line, code in BLOCKS]
)
def test_readme_python_block_runs(line, code, tmp_path):
    where = f"README.md's python block at line {line}"
    header = TORCHRUN.fullmatch(code.splitlines()[0])
    if header is None:
        assert not STARTS_RANKS.search(code), (
            f"{where} starts ranks but does not begin with '# torchrun --nproc-per-node N "
            "example.py', so it is neither a single-process nor a torchrun example"
        )
        _run([sys.executable, "-c", code], tmp_path, where)
        return
    ranks, file_name = header.groups()
    (tmp_path / file_name).write_text(code)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks]
    _run([*launcher, "--master-port", str(_free_port()), file_name], tmp_path, where)
