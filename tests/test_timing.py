"""Stall windows, EWTT, AGST, the Chrome trace, and Eq. (1) from probed link rates (no meshes)."""

import json

import pytest
from planning_layouts import one_tensor_plan

from controller.timing import chrome_trace, update_timing, write_timeline
from weightbridge import Cluster, Placement, simulate
from weightbridge.planning.ideal import eq1

MS = 1_000_000  # ns

# Two trainers and two rollouts, one round; trainer 0 writes to rollout 0, trainer 1 to
# rollout 1, and rollout 0 forwards to rollout 1 (external).
SPANS = {
    ("trainer", 0): [("pack", 0, 100 * MS, 101 * MS), ("receive", 0, 101 * MS, 110 * MS)],
    ("trainer", 1): [("pack", 0, 102 * MS, 103 * MS), ("receive", 0, 103 * MS, 120 * MS)],
    ("rollout", 0): [("external", 0, 121 * MS, 130 * MS), ("assemble", 0, 131 * MS, 133 * MS)],
    ("rollout", 1): [("external", 0, 121 * MS, 121 * MS), ("assemble", 0, 131 * MS, 140 * MS)],
}
DESTS = {("trainer", 0, 0, "receive"): frozenset({0}),
         ("trainer", 1, 0, "receive"): frozenset({1}),
         ("rollout", 0, 0, "external"): frozenset({1})}


def test_stall_windows_follow_the_controller_driven_sync_definitions():
    t = update_timing(SPANS, DESTS)
    assert t.start_ns == 100 * MS  # the first send
    assert t.stalls[("trainer", 0)] == (100 * MS, 110 * MS)  # until its last write landed
    assert t.stalls[("trainer", 1)] == (100 * MS, 120 * MS)
    assert t.stalls[("rollout", 0)] == (101 * MS, 133 * MS)  # first write aimed at it
    assert t.stalls[("rollout", 1)] == (103 * MS, 140 * MS)
    assert t.ewtt_s == pytest.approx(0.040)
    assert t.agst_s == pytest.approx((10 + 20 + 32 + 37) / 4 / 1e3)
    assert t.agst_s <= t.ewtt_s


def test_kernel_share_is_pack_and_assemble_over_ewtt():
    t = update_timing(SPANS, DESTS)
    mean, peak = t.kernel_share()
    assert mean == pytest.approx((1 + 1 + 2 + 9) / 4 / 40)
    assert peak == pytest.approx(9 / 40)


def test_a_worker_without_spans_does_not_stall_and_one_nobody_writes_starts_at_the_update():
    spans = {**SPANS, ("rollout", 2): [("assemble", 0, 131 * MS, 132 * MS)],
             ("trainer", 2): []}
    t = update_timing(spans, DESTS)
    assert t.stalls[("trainer", 2)] == (100 * MS, 100 * MS)
    assert t.stalls[("rollout", 2)] == (100 * MS, 132 * MS)
    assert t.agst_s == pytest.approx((10 + 20 + 32 + 37 + 0 + 32) / 6 / 1e3)


def test_no_spans_at_all_is_an_error():
    with pytest.raises(ValueError, match="no spans"):
        update_timing({("trainer", 0): []}, {})


def test_chrome_trace_has_one_complete_event_per_rank_stage_round():
    trace = json.loads(json.dumps(chrome_trace(update_timing(SPANS, DESTS))))
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "stall"]
    keys = [(e["pid"], e["tid"], e["cat"], e["args"]["round"]) for e in steps]
    assert len(keys) == len(set(keys)) == sum(len(s) for s in SPANS.values())
    assert min(e["ts"] for e in steps) == 0.0  # microseconds from the first send
    recv = next(e for e in steps if (e["pid"], e["tid"], e["cat"]) == (0, 1, "receive"))
    assert (recv["ts"], recv["dur"]) == (3000.0, 17000.0)
    stalls = [e for e in trace["traceEvents"] if e.get("cat") == "stall"]
    assert len(stalls) == 4 and max(e["ts"] + e["dur"] for e in stalls) == 40000.0


def test_eq1_with_one_rate_is_the_simulators_ideal():
    plan = one_tensor_plan(2, 3)
    cluster = Cluster(gpus_per_node=1, inter_node_bandwidth=100.0, intra_node_bandwidth=1e3)
    assert eq1(plan, trainer_node_bandwidth=100.0, rollout_node_bandwidth=100.0) == \
        simulate(plan, cluster).ideal


def test_eq1_takes_the_slower_of_trainer_egress_and_rollout_ingress():
    model = 256 * 64 * 4
    plan = one_tensor_plan(2, 3)  # 2 trainer nodes; every rollout node needs the whole model
    assert eq1(plan, trainer_node_bandwidth=10.0, rollout_node_bandwidth=100.0) == \
        pytest.approx(model / 20.0)
    assert eq1(plan, trainer_node_bandwidth=100.0, rollout_node_bandwidth=10.0) == \
        pytest.approx(model / 10.0)
    with pytest.raises(ValueError, match="positive"):
        eq1(plan, trainer_node_bandwidth=0.0, rollout_node_bandwidth=1.0)


def test_eq1_counts_what_each_rollout_node_needs():
    from weightbridge import SourceMap, plan_transfer
    from weightbridge.types import ParamSpec, Piece, Region

    def smap(rows):  # rows [lo, hi) of a 256 x 64 float32 tensor
        reg = Region("w", (rows[0], 0), (rows[1] - rows[0], 64), (1, 1))
        return SourceMap((ParamSpec("w", (rows[1] - rows[0], 64), "float32"),),
                         (Piece(reg, "w", 0, (64, 1)),))

    plan = plan_transfer([(smap((0, 256)), Placement("t"))],
                         [(smap((0, 64)), Placement("r0", engine=0)),
                          (smap((64, 256)), Placement("r1", engine=1))], round_bytes=4096)
    # The busiest node needs rows 64..255 (48 KiB); the trainer node sends all 64 KiB.
    assert eq1(plan, trainer_node_bandwidth=1e6, rollout_node_bandwidth=1.0) == \
        pytest.approx(192 * 64 * 4)


def test_staging_modes_count_the_staged_copy_and_the_install_not_the_rounds():
    from controller.timing import UpdateTiming
    from weightbridge.config import Mode

    t = UpdateTiming(start_ns=0, spans={}, stalls={("trainer", 0): (0, 4_000_000_000),
                                                  ("rollout", 0): (0, 2_000_000_000)})
    sync, ss, both = (t.mode_agst_s(m, trainer_stall_s=0.5, install_s=0.25)
                      for m in (Mode.SYNC, Mode.SS, Mode.ASYNC))
    assert (sync, ss, both) == (t.agst_s, (0.5 + 2) / 2, (0.5 + 0.25) / 2) == (3.0, 1.25, 0.375)


def test_the_write_timeline_splits_the_links_idle_time_at_the_buffer_it_waited_for():
    """Round 1's writes wait for round 0's buffer (depth 1 here), which lands at 12 ms: of the
    4 ms gap, 2 ms are before that land and 2 ms after it (the trips, the pack)."""
    spans = {("trainer", 0): [("pack", 0, 0, MS), ("receive", 0, 0, 10 * MS),
                              ("receive", 1, 14 * MS, 20 * MS)],
             ("trainer", 1): [("receive", 0, 2 * MS, 9 * MS)],  # inside trainer 0's: no gap
             ("rollout", 0): [("assemble", 0, 11 * MS, 12 * MS), ("assemble", 1, 21 * MS, 25 * MS)]}
    t = write_timeline(update_timing(spans, {}), depth=1)
    assert (t.writes_s, t.idle_s, t.buffer_wait_s, t.drain_s) == pytest.approx(
        (0.020, 0.004, 0.002, 0.005))
    # With depth 2 no round waits for a buffer: the gap is all trips.
    assert write_timeline(update_timing(spans, {}), depth=2).buffer_wait_s == 0
    # Receiver staging lands round 0 in a slot ("stage"), not the parameters: the same wait.
    staged = {**spans, ("rollout", 0): [("stage", 0, 11 * MS, 12 * MS),
                                        ("stage", 1, 21 * MS, 25 * MS)]}
    assert write_timeline(update_timing(staged, {}), depth=1).buffer_wait_s == pytest.approx(0.002)


def test_a_write_timeline_needs_trainer_writes():
    with pytest.raises(ValueError, match="no trainer wrote"):
        write_timeline(update_timing({("rollout", 0): [("assemble", 0, 0, MS)]}, {}), depth=2)
