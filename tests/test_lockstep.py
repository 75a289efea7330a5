"""``testing.property_in_lockstep``: every rank checks the same examples, whatever each
rank's process holds."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
from hypothesis import strategies as st

from compiled_logprob.testing.multiprocess import property_in_lockstep


def _load_rank_constants() -> None:
    """A loaded local module whose integer literals differ by rank, as Inductor's generated
    kernels do (each rank compiles its own shard's shapes). Hypothesis draws some numbers
    from such literals, so ranks each running Hypothesis would draw different examples."""
    rank = dist.get_rank()
    name = f"rank_constants_{rank}"
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text("".join(f"C{i} = {100_003 + 1_000 * rank + i}\n" for i in range(64)))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _same_example_everywhere(drawn: int) -> None:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, drawn)
    assert len(set(everyone)) == 1, f"ranks checked different examples: {everyone}"


def _property() -> None:
    _load_rank_constants()
    property_in_lockstep(st.integers(0, 10**6), _same_example_everywhere, max_examples=300)


def test_ranks_check_the_same_examples(gloo_pool):
    gloo_pool(2).run(_property)
