"""`python -m controller` as a user runs it: any model through a worker factory, and bad
input refused with one line and exit 2 before any proc spawns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshprocs import bootstrap_children

ROOT = Path(__file__).resolve().parent.parent


def _controller(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "controller", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.mesh
def test_a_model_the_controller_has_never_seen_transfers_bit_exact_through_its_factory():
    before = bootstrap_children()
    run = _controller("--workers", "examples.custom_model:mlp", "--trainer",
                      "nodes=1,gpus=2,tp=2", "--rollout", "engines=2,nodes=1,gpus=1",
                      "--updates", "2", "--round-kib", "64")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("update ")]
    assert len(lines) == 2, run.stdout
    assert all("rollout parameters bit-identical to their own load_weights" in ln
               for ln in lines), lines
    assert bootstrap_children() - before == set()


@pytest.mark.parametrize("args,message", [
    (("--workers", "examples.custom_model:nope"), "has no callable 'nope'"),
    (("--workers", "no_such_module:factory"), "does not import"),
    (("--workers", "examples.custom_model"), "or a worker factory as module:name"),
    (("--round-kib", "0"), "--round-kib must be a positive"),
    (("--round-kib", "-1"), "--round-kib must be a positive"),
    (("--updates", "0"), "--updates must be at least 1"),
    (("--depth", "1"), "--depth must be >= 2"),
    (("--timeout", "0"), "timeout_s must be a positive"),
    (("--trainer", "nodes=1,gpus=3,tp=2"), "must divide"),
])
def test_bad_input_exits_2_with_one_line_before_anything_spawns(args, message):
    before = bootstrap_children()
    run = _controller(*args, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert bootstrap_children() - before == set()
