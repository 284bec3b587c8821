"""`python -m controller` as a user runs it: any model through a worker factory, and bad
input refused with one line and exit 2 before any proc spawns."""

from __future__ import annotations

import json
import os
import re
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
    # What connect took, step by step, and what came from the caches (a second run: kept).
    assert re.search(r"^connect [0-9.]+s: config check [0-9.]+s, source maps [0-9.]+s "
                     r"\((probed|kept)\), plan [0-9.]+s \((planned|kept)\), set-up [0-9.]+s, "
                     r"link probe [0-9.]+s; ",
                     run.stdout, re.M), run.stdout
    assert bootstrap_children() - before == set()


CLUSTER_ATTACH = ("--attach-trainers", "tcp://127.0.0.1:1",
                  "--attach-rollouts", "tcp://127.0.0.1:2,tcp://127.0.0.1:3")
BAD_INPUT = {
    # flags out of range, on the mesh run and on --cluster (refused before it brings anything up)
    "round-kib 0": (("--round-kib", "0"), "--round-kib must be a positive"),
    "round-kib -1": (("--round-kib", "-1"), "--round-kib must be a positive"),
    "cluster round-kib 0": (("--cluster", "--round-kib", "0"), "--round-kib must be a positive"),
    "link-mbit -5": (("--link-mbit", "-5"), "--link-mbit must be a positive"),
    "cluster link-mbit -5": (("--cluster", "--link-mbit", "-5"), "--link-mbit must be a positive"),
    "cluster link-mbit 0": (("--cluster", "--link-mbit", "0"), "--link-mbit must be a positive"),
    "updates 0": (("--updates", "0"), "--updates must be at least 1"),
    "updates -2": (("--updates", "-2"), "--updates must be at least 1"),
    "cluster updates -2": (("--cluster", "--updates", "-2"), "--updates must be at least 1"),
    "depth 1": (("--depth", "1"), "--depth must be >= 2"),
    "cluster depth 1": (("--cluster", "--depth", "1"), "--depth must be >= 2"),
    "timeout 0": (("--timeout", "0"), "--timeout 0: timeout_s must be a number of seconds in"),
    "timeout -1": (("--timeout", "-1"), "--timeout -1: timeout_s must be a number of seconds"),
    "timeout 1e300": (("--timeout", "1e300"), "--timeout 1e+300: timeout_s must be a number of"),
    "timeout inf": (("--timeout", "inf"), "--timeout inf: timeout_s must be a number of"),
    "trace in no folder": (("--trace", "/no-such-folder/t.json"), "in an existing folder"),
    "not an int": (("--updates", "abc"), "invalid int value: 'abc' (see --help)"),
    # --cluster N and the flags a cluster run would ignore
    "cluster 5": (("--cluster", "5"), "2 rollout nodes): give --cluster 3 or --cluster alone"),
    "cluster -1": (("--cluster", "-1"), "give a positive number of hosts"),
    "cluster attach": (("--cluster", *CLUSTER_ATTACH),
                       "would ignore --attach-trainers, --attach-rollouts"),
    "cluster bad spec": (("--cluster", "--trainer", "nodes=1,gpus=3,tp=2"), "must divide"),
    "cluster bad factory": (("--cluster", "--workers", "examples.custom_model:nope"),
                            "has no callable 'nope'"),
    # specs: unknown or repeated keys, zero values, layouts that do not fit, fsdp not a switch
    "unknown key": (("--trainer", "nodes=1,gpus=4,dp=2"), "expected key=value"),
    "repeated key": (("--trainer", "gpus=4,gpus=3,tp=2"), "sets gpus twice"),
    "layout": (("--trainer", "nodes=1,gpus=3,tp=2"), "must divide"),
    "zero engines": (("--rollout", "engines=0,gpus=2,tp=2"), "engines must be >= 1"),
    "zero gpus, own factory": (("--workers", "examples.custom_model:mlp", "--trainer", "gpus=0"),
                               "TrainerSpec.gpus must be >= 1"),
    "fsdp=2": (("--trainer", "nodes=1,gpus=4,fsdp=2"), "fsdp is a switch, 0 or 1"),
    "fsdp=2 with tp, ep": (("--trainer", "nodes=1,gpus=4,tp=2,ep=2,fsdp=2"), "fsdp is a switch"),
    "fsdp=-1": (("--trainer", "gpus=4,fsdp=-1"), "fsdp is a switch"),
    # worker factories, and --model where --workers replaces the demo model
    "no callable": (("--workers", "examples.custom_model:nope"), "has no callable 'nope'"),
    "no module": (("--workers", "no_such_module:factory"), "does not import"),
    "no colon": (("--workers", "examples.custom_model"), "or a worker factory as module:name"),
    "model and workers": (("--model", "small", "--workers", "examples.custom_model:mlp"),
                          "replaces it: drop one of them"),
    "attach one side": (("--attach-trainers", "tcp://127.0.0.1:1"), "go together"),
    # multi-host runs are mutual TLS unless --insecure (controller/security.py)
    "attach without tls": (("--trainer", "nodes=1,gpus=2,tp=2", "--rollout",
                            "engines=2,nodes=1,gpus=1", "--attach-trainers", "tls://10.1.0.2:1",
                            "--attach-rollouts", "tls://10.1.0.3:1,tls://10.1.0.4:1"),
                           "no TLS files: multi-host runs are authenticated"),
    "cluster without tls": (("--cluster", "--trainer", "nodes=1,gpus=2,tp=2", "--rollout",
                             "engines=2,nodes=1,gpus=1"),
                            "make the files with `python -m controller.certs make DIR --hosts "
                            "10.77.0.2,10.77.0.3,10.77.0.4 --controller 10.77.0.1`"),
    "insecure on this host": (("--insecure",), "only apply to multi-host runs"),
    # --local: its own flags checked, the flags it would ignore refused
    "local round-kib 0": (("--local", "--round-kib", "0"), "--round-kib must be a positive"),
    "local updates": (("--local", "--updates", "5"), "it would ignore --updates: drop it"),
    "local spec": (("--local", "--trainer", "nodes=1,gpus=2,tp=2"), "runs the fixed layouts"),
    "local workers trace": (("--local", "--workers", "examples.custom_model:mlp", "--trace",
                             "/tmp/wb-trace.json"), "would ignore --workers, --trace"),
}


REFUSALS = """
import contextlib, io, json, sys
from controller.__main__ import main
out = {}
for case, argv in json.loads(sys.argv[1]).items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out[case] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""
"""Runs `controller.__main__.main` on each case's arguments in one interpreter: one start-up
(torch and Monarch imports, 2-3 s) for all of them instead of one each."""


@pytest.fixture(scope="module")
def refusals() -> dict:
    """Each `BAD_INPUT` case's (exit status, stdout, stderr), and the procs spawned meanwhile."""
    before = bootstrap_children()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    cases = {case: list(args) for case, (args, _) in BAD_INPUT.items()}
    run = subprocess.run([sys.executable, "-c", REFUSALS, json.dumps(cases)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"cases": json.loads(run.stdout.splitlines()[-1]),
            "spawned": bootstrap_children() - before}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_before_anything_spawns(refusals, case):
    code, stdout, stderr = refusals["cases"][case]
    assert code == 2, stdout + stderr
    lines = stderr.splitlines()
    message = BAD_INPUT[case][1]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert "Traceback" not in stderr
    assert stdout == ""  # nothing ran: no emulated cluster, no "spawned meshes" line
    assert refusals["spawned"] == set()


@pytest.mark.parametrize("case", ["round-kib 0", "cluster 5", "no module"])
@pytest.mark.slow
def test_bad_input_to_python_m_controller_exits_2_with_one_line(case):
    # A few cases as a user types them, through `python -m controller` (the rest run in one
    # interpreter, `refusals`).
    args, message = BAD_INPUT[case]
    before = bootstrap_children()
    run = _controller(*args, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert bootstrap_children() - before == set()
