"""A dead proc under the library's meshes is the transfer's to report, not the end of the
controller's process (`weightbridge.mesh.faults`).

Monarch's default hook for an unhandled mesh fault exits the process (a KeyboardInterrupt in
the main thread); tests/conftest.py replaces it for the test process, so the end-to-end case
runs in a child process with Monarch's default in place.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightbridge.mesh import faults

REPO = Path(__file__).resolve().parents[1]

LOSS = """
import os, sys, time
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
from controller.driver import MeshTransfer
from faults import DiesInRound1Rollout
from weightbridge import TransferConfig, WorkersLost
from weightbridge.specs import RolloutSpec, TrainerSpec
with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=1"),
                  RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny",
                  rollout_actor=DiesInRound1Rollout,
                  config=TransferConfig(round_bytes=64 << 10, timeout_s=5)) as mt:
    mt.connect()
    try:
        mt.update(1)
    except WorkersLost as e:
        print("lost engines", sorted(e.lost_engines), flush=True)
    print("re-sent:", mt.wait().line(), flush=True)
    print("next:", mt.update(2).line(), flush=True)
    # Monarch delivers the proc's fault when it gets to it: wait for it (bounded), so that
    # the default hook, where it is in place, has its chance to end this process.
    from weightbridge.mesh import faults
    deadline = time.monotonic() + 60
    while not faults.seen and time.monotonic() < deadline:
        time.sleep(0.1)
    print("faults seen:", len(faults.seen), flush=True)
print("closed", flush=True)
"""


@pytest.mark.mesh
def test_a_dead_rollout_proc_is_reported_and_the_controller_goes_on():
    """Before: the fault of rollout 1's proc reached Monarch's default hook, and the
    controller's process died with a KeyboardInterrupt (after the re-send, in update 2)."""
    env_path = f"{REPO}:{REPO / 'tests'}"
    done = subprocess.run([sys.executable, "-c", LOSS], cwd=REPO, capture_output=True, text=True,
                          timeout=280, env={**os.environ, "PYTHONPATH": env_path})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "lost engines [1]" in done.stdout, out[-3000:]
    assert "re-sent: update 1" in done.stdout and "bit-identical" in done.stdout, out[-3000:]
    assert "next: update 2" in done.stdout and "closed" in done.stdout, out[-3000:]
    assert "faults seen: 0" not in done.stdout, out[-3000:]  # (it came, and was the library's)


class _Mesh:
    def __init__(self, name):
        self._name = type("F", (), {"get": lambda _self: name})()


class _Failure:
    def __init__(self, name):
        self.mesh_name = name

    def __str__(self):
        return f"MeshFailure(mesh_name={self.mesh_name})"


def test_faults_of_owned_meshes_are_recorded_and_others_go_to_the_hook_before(monkeypatch):
    import monarch.actor

    before = []
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", before.append)
    monkeypatch.setattr(faults, "_owned", set())
    monkeypatch.setattr(faults, "seen", [])
    mesh = _Mesh("rollout-abc")
    faults.own_faults(mesh)
    hook = monarch.actor.unhandled_fault_hook
    assert hook is faults._hook
    hook(_Failure("rollout-abc"))
    hook(_Failure("logger-xyz"))  # Monarch's per-proc mesh, while the library owns meshes
    users = _Failure("my-trainers-123")
    hook(users)
    assert faults.seen == ["MeshFailure(mesh_name=rollout-abc)",
                           "MeshFailure(mesh_name=logger-xyz)"]
    assert before == [users]
    faults.disown_faults(mesh)
    hook(_Failure("rollout-abc"))
    hook(_Failure("logger-xyz"))
    assert [f.mesh_name for f in before] == ["my-trainers-123", "rollout-abc", "logger-xyz"]


CLI_LOSS = """
import sys
import controller.driver as driver
from controller.__main__ import main
from faults import DiesInRound1Rollout
real = driver.MeshTransfer
driver.MeshTransfer = lambda *a, **k: real(*a, rollout_actor=DiesInRound1Rollout, **k)
main(sys.argv[1:])
"""


@pytest.mark.mesh
@pytest.mark.parametrize("mode", ["sync", "ss"])
def test_the_controller_command_reports_a_lost_engine_and_finishes_on_the_others(mode):
    """Before: `python -m controller` ended in a WorkersLost traceback at update 1 (exit 1)."""
    args = ["--trainer", "nodes=1,gpus=1", "--rollout", "engines=2,nodes=1,gpus=1",
            "--updates", "3", "--round-kib", "64", "--timeout", "5", "--mode", mode]
    done = subprocess.run([sys.executable, "-c", CLI_LOSS, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    out = done.stdout + done.stderr
    assert done.returncode == 3, out[-3000:]  # (cli.WORKERS_LOST)
    assert "Traceback" not in done.stderr, out[-3000:]
    assert "update 1: " in done.stderr and "Engine [1] is excluded" in done.stderr, out[-3000:]
    if mode == "sync":  # re-sent to engine 0 from the trainers' parameters
        assert "re-sent: update 1" in done.stdout, out[-3000:]
    for version in (2, 3):  # the next updates reach engine 0 whole
        line = next(text for text in done.stdout.splitlines()
                    if text.startswith(("update ", "  streamed: update "))
                    and f"update {version}" in text and "bit-identical" in text)
        assert "MISMATCH" not in line, line
