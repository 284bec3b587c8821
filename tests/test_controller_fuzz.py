"""The controller's protocol fuzz (tests/fuzz_controller.py) on real Monarch meshes: a seed of
each mode (and sync with whole rounds) shows no violation, and the fuzz's check sees an
engine that does not hold what it must (so a clean run means something).
`benchmarks/fuzz_protocol.py --path controller` runs many seeds. Each `MeshTransfer` is
closed even when a test fails (`run_seeds`, ``finally``).
"""

from __future__ import annotations

import pytest

from fuzz_controller import MODES, _Group, round_control, run_seeds

pytestmark = pytest.mark.mesh


@pytest.mark.parametrize("seed", [*range(len(MODES)), len(MODES)],
                         ids=[*MODES, "sync-rounds"])
def test_one_seed_of_each_mode_shows_no_violation(seed):
    # (one test per mode: each runs a group of its own, and the suite's workers share them;
    # seed 4 is sync with whole rounds)
    results = run_seeds([seed], num_ops=3, timeout_s=5.0)
    assert [(r.mode, r.round_control) for r in results] == [
        (MODES[seed % len(MODES)], round_control(seed))]
    assert all(len(r.ops) == 3 for r in results)
    bad = {r.seed: r.violations for r in results if r.violations}
    assert not bad, bad


def test_the_fuzz_check_sees_an_engine_that_holds_another_version():
    group = _Group("sync", "stages", 5.0)
    try:
        group.violations, group.refusals = [], []
        assert group._send("update")
        group._check("update")
        assert group.violations == []
        group.holds = dict.fromkeys(group.holds, group.version + 1)  # (not what they hold)
        group._check("a wrong book")
        assert [v.kind for v in group.violations] == ["stale"], group.violations
    finally:
        group.close()
