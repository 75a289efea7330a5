"""Types a user can rely on: mypy (default mode) finds nothing in the package nor in
``typed_usage.py``, a typed user's script, and it does reject calls that misread a result,
so the overloads are not silently ``Any``. The script also runs, so it cannot rot."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USAGE = Path(__file__).resolve().parent / "typed_usage.py"

# Each line misreads a result; mypy must flag every one (the error code in the comment).
MISUSE = """\
import torch
import compiled_logprob as cl
from compiled_logprob import nemo_compat

x, ids = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
pair: tuple[torch.Tensor, torch.Tensor] = cl.token_logprobs(x, ids)  # assignment
alone: torch.Tensor = cl.token_logprobs(x, ids, return_entropy=True)  # assignment
cl.context_parallel_logprobs(x, ids, return_entropy=True).sum()  # attr-defined
cl.lm_head_token_logprobs(x, x[0], ids, return_entropy=True).sum()  # attr-defined
_, _, h = nemo_compat.get_distillation_topk_logprobs_from_logits(x, x, ids[..., None], True, False)
h.sum()  # attr-defined
"""


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory):
    """``(report, misuse path)`` of one mypy run, in default mode with the repository's
    configuration, over the package, ``typed_usage.py`` and :data:`MISUSE`. A subprocess,
    not ``mypy.api.run``: in this one, freeing what mypy read of torch adds ~10 s at exit."""
    pytest.importorskip("mypy")
    work = tmp_path_factory.mktemp("mypy")
    misuse = work / "misuse.py"
    misuse.write_text(MISUSE)
    command = [
        sys.executable, "-m", "mypy",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(work / "cache"),
        "--no-error-summary",
        "--show-error-codes",
        str(ROOT / "compiled_logprob"),
        str(USAGE),
        str(misuse),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    if done.returncode not in (0, 1):  # 1: errors found (the misuse's); 2: mypy failed
        pytest.fail(f"mypy exited with {done.returncode}:\n{report}")
    return report, misuse


def test_package_and_typed_usage_are_clean(mypy_report):
    report, misuse = mypy_report
    lines = report.splitlines()
    errors = [line for line in lines if " error: " in line and str(misuse) not in line]
    assert not errors, "mypy (default mode) reports:\n" + report


def test_misread_results_are_errors(mypy_report):
    report, misuse = mypy_report
    expected = {
        number: code
        for number, line in enumerate(MISUSE.splitlines(), 1)
        for code in re.findall(r"# ([a-z-]+)$", line)
    }
    found = {
        int(number): code
        for number, code in re.findall(
            rf"^{re.escape(str(misuse))}:(\d+): error: .*\[([a-z-]+)\]$", report, re.MULTILINE
        )
    }
    assert found == expected, "mypy reports:\n" + report


def test_typed_usage_runs():
    runpy.run_path(str(USAGE), run_name="__main__")
