"""The GRPO example runs end to end (`examples/grpo`): FSDP2 trainers, a generating vLLM engine
of TP 2, a WeightBridge update after every optimizer step, and the example's own checks that
the engine is bit-identical to a fresh engine loaded from the trainers' weights."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engines, pytest.mark.mesh]

REPO = Path(__file__).resolve().parents[2]


def test_grpo_example_updates_the_engine_every_step_bit_identically(tmp_path):
    done = subprocess.run([sys.executable, "-m", "examples.grpo", "--modes", "sync", "async",
                           "--steps", "3", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for mode in ("sync", "async"):
        assert (tmp_path / f"grpo-{mode}.png").stat().st_size > 0
    steps = re.findall(r"^step (\d+) reward ([\d.]+) sync (\d+) ms of step (\d+) ms", out, re.M)
    assert [int(s[0]) for s in steps] == [1, 2, 3] * 2, out
    # The checks at the first and last step of each mode.
    assert len(re.findall(r"^step [13]: bit-identical", out, re.M)) == 4, out
    assert len(re.findall(r"^reward [\d.]+ -> [\d.]+", out, re.M)) == 2, out
