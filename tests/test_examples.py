"""The examples run as written (the walkthrough is also a notebook: `# %%` cells)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.mesh
def test_walkthrough_transfers_and_verifies_then_stops_its_meshes():
    done = subprocess.run([sys.executable, str(REPO / "examples" / "walkthrough.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bit-identical to their own load_weights(v1)" in done.stdout
    assert done.stdout.rstrip().endswith("meshes stopped")
