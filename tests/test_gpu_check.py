"""`bash scripts/dev.sh gpu-check` here, where no GPU is: it says so and succeeds; its parsing of
the kernel benchmark's rows gives each row its target's verdict."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

ROWS = """summary (bytes of the round per second; copy = torch copy of the same bytes):
4 KB regions     65536 boxes   256.0 MiB | copy   2900 GB/s | pack    900 GB/s (0.31x copy) | assemble    800 GB/s (0.28x) | 1 launch, 65536 programs | pack share of round 1.0% | build     5 ms, first pack   1204 ms
64 KB regions     4096 boxes   256.0 MiB | copy   2900 GB/s | pack   2500 GB/s (0.86x copy) | assemble   2400 GB/s (0.83x) | 1 launch, 8192 programs | pack share of round 1.0% | build     6 ms, first pack   472 ms
1 MB regions       256 boxes   256.0 MiB | copy   2900 GB/s | pack   2000 GB/s (0.69x copy) | assemble   2600 GB/s (0.90x) | 1 launch, 8192 programs | pack share of round 1.0% | build     2 ms, first pack   356 ms
mixed round         75 boxes     0.7 MiB | copy   2900 GB/s | pack   1600 GB/s (0.55x copy) | assemble   1500 GB/s (0.52x) | 1 launch, 214 programs | pack share of round 1.0% | build     3 ms, first pack   609 ms
"""


def test_kernel_rows_get_their_targets_verdict():
    lines = gpu_check.kernel_verdicts("per-row progress lines first\n" + ROWS)
    assert [ln.rsplit("| ", 1)[1] for ln in lines] == [
        "no target", "target 0.8x: ok", "target 0.8x: BELOW", "target 0.5x: ok"]
    assert all(ln.startswith("gpu-check: kernels: ") for ln in lines)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_cuda_it_says_so_and_exits_0():
    out = subprocess.run(["bash", "scripts/dev.sh", "gpu-check"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device is visible" in out.stdout and "nothing run" in out.stdout


def test_an_unknown_step_is_refused_before_anything_runs():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--only", "triton,prob"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown step(s) prob" in out.stderr and "choose from" in out.stderr


def test_interpreter_rows_get_no_verdict():
    lines = gpu_check.kernel_verdicts(ROWS, judged=False)
    assert len(lines) == 4 and all(ln.endswith("| interpreter: no verdict") for ln in lines)


@pytest.mark.slow
def test_interpret_runs_the_checksum_and_probe_steps_on_the_cpu():
    """--interpret: the steps' code paths with no GPU (here: this venv's torch and triton; the
    docs' prepared command runs it under a GPU machine's torch 2.11 and triton 3.6)."""
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--only", "checksum,probe",
                          "--interpret", "--probe-gib", "0.01"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("gpu-check: checksum:    1 MiB") for ln in lines)
    assert any(ln.startswith("gpu-check: probe: 1-layer rank") and "CPU parameters" in ln
               for ln in lines)
    assert lines[-1] == "gpu-check: 2 of 2 steps passed"


def test_interpret_refuses_the_mesh_step_before_anything_runs():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--only", "probe,mesh",
                          "--interpret"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--interpret runs no mesh step" in out.stderr


def test_a_step_past_its_limit_fails_with_what_it_printed(monkeypatch, capsys):
    """A step stopped at its limit hands back its output as bytes even with text=True: the
    check reports it (it raised TypeError concatenating bytes and str)."""
    monkeypatch.setitem(gpu_check.BUDGET_S, "checksum", 1)
    ok, text = gpu_check._run("checksum", [sys.executable, "-c",
                                           "import time; print('started', flush=True); "
                                           "time.sleep(30)"])
    assert not ok and "started" in text
    assert "checksum: FAILED (did not finish within 1 s)" in capsys.readouterr().out
