"""The project's lint, run by the test command: ruff, configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in run.stderr, (
        "ruff is not installed: it is in the test extras (pip install -e '.[test]', or "
        "bash scripts/dev.sh setup)")
    assert run.returncode == 0, run.stdout + run.stderr
