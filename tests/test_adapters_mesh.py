"""The adapters on real Monarch meshes (CPU tensors, TCP RDMA fallback): `examples/rl_loop.py`
in each mode, trainer TP2 -> two TP2 engines, the engines stepping on their own.

Checked per mode: every install bit-exact against the rank's own load_weights, no engine step
with mixed versions, versions installed in increasing order on every rank, every engine ends
on the last version; sync mode never runs a step older than a version whose send_weights
returned. Rollouts that do not poll: trainers in SS/async still finish every send_weights,
sync mode raises a clear TimeoutError.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from meshprocs import proc_pair

pytestmark = pytest.mark.mesh

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("rl_loop", REPO / "examples" / "rl_loop.py")
rl_loop = importlib.util.module_from_spec(_spec)
sys.modules["rl_loop"] = rl_loop  # dataclasses look their module up while the class is built
_spec.loader.exec_module(rl_loop)

NUM_VERSIONS = 3


@pytest.fixture(scope="module")
def procs():
    with proc_pair(rl_loop.TRAINER_TP, rl_loop.ENGINES * rl_loop.ENGINE_TP) as meshes:
        yield meshes


@pytest.mark.parametrize("round_control", ["stages", "rounds"])
@pytest.mark.parametrize("mode", list(rl_loop.MODES))
def test_rl_loop_installs_consistent_bit_exact_versions_in_order(mode, round_control, procs):
    report = rl_loop.run_loop(mode, procs, num_versions=NUM_VERSIONS,
                              round_control=round_control)
    assert report.inexact == 0 and report.installs > 0
    assert report.mixed_steps == 0
    assert report.final_versions == [NUM_VERSIONS] * rl_loop.ENGINES
    by_rank: dict[int, list[int]] = {}
    for r in sorted(report.records, key=lambda r: (r["rank"], r["step"])):
        if r["installed"] is not None:
            by_rank.setdefault(r["rank"], []).append(r["installed"])
    for rank, got in by_rank.items():
        assert got == sorted(set(got)), (rank, got)
    if mode == "sync":
        # send_weights(v) returned only once every rollout installed v.
        assert set(report.staleness) == {0}, report.staleness


@pytest.mark.parametrize("mode", ["ss", "rs", "async"])
def test_trainers_finish_while_no_rollout_polls_in_staging_modes(mode, procs):
    report = rl_loop.run_loop(mode, procs, num_versions=NUM_VERSIONS,
                              generate_after_training=True)
    assert report.final_versions == [NUM_VERSIONS] * rl_loop.ENGINES
    assert report.inexact == 0 and report.mixed_steps == 0
    if mode != "rs":  # SS: the versions staged meanwhile superseded each other
        assert report.installs == rl_loop.ENGINES * rl_loop.ENGINE_TP


def test_sync_mode_times_out_clearly_when_no_rollout_polls(procs):
    with pytest.raises(Exception, match="did not poll_requests"):
        rl_loop.run_loop("sync", procs, num_versions=1, timeout_s=3,
                         generate_after_training=True)
