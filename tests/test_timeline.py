"""The calibrated update model (timeline) and the fit of its overheads: pure, no Monarch."""

import dataclasses
import math
import pickle

import pytest

from weightbridge import Cluster, Placement, SourceMap, plan_transfer
from weightbridge.types import ParamSpec, Piece, Region
from weightbridge import simulate
from weightbridge.simulation.calibrate import (Run, _line, fit_overheads, load_runs,
                                              point_cluster)
from weightbridge.simulation.timeline import Overheads

LINK = Cluster(gpus_per_node=1, inter_node_bandwidth=1e6, intra_node_bandwidth=1e9)
MODEL = 256 * 64 * 4  # bytes


def _plan(num_trainers, num_rollouts, round_bytes=16 << 10):
    reg = Region("w", (0, 0), (256, 64), (1, 1))
    smap = SourceMap((ParamSpec("w", (256, 64), "float32"),), (Piece(reg, "w", 0, (64, 1)),))
    return plan_transfer([(smap, Placement(f"t{i}")) for i in range(num_trainers)],
                         [(smap, Placement(f"r{i}", engine=i)) for i in range(num_rollouts)],
                         round_bytes=round_bytes)


def test_one_link_without_overheads_takes_bytes_over_rate():
    est = simulate(_plan(1, 1), LINK, overheads=Overheads(), depth=2)
    assert est.ewtt == pytest.approx(MODEL / 1e6, rel=1e-6)
    assert est.ewtt == pytest.approx(est.ideal, rel=1e-6)


def test_goodput_and_control_latency_add_what_they_cost():
    plan = _plan(1, 1, round_bytes=2 * MODEL)  # one round: nothing overlaps
    assert plan.num_rounds == 1
    slow = simulate(plan, LINK, overheads=Overheads(link_efficiency=0.5), depth=2)
    assert slow.ewtt == pytest.approx(2 * MODEL / 1e6, rel=1e-6)
    late = simulate(plan, LINK, overheads=Overheads(control_s=0.01, copy_bandwidth=1e7),
                    depth=2)
    # pack, write, its reply, the land message (no forward step: nothing to forward), assemble,
    # its reply (EWTT runs from the pack to the end of the assemble)
    assert late.ewtt == pytest.approx(MODEL / 1e7 + MODEL / 1e6 + 2 * 0.01 + MODEL / 1e7,
                                      rel=1e-6)


def test_slower_cores_stretch_what_a_cpu_pays_and_not_the_links():
    plan = _plan(1, 1, round_bytes=2 * MODEL)  # one round, as above
    fitted = Overheads(control_s=0.01, copy_bandwidth=1e7, link_efficiency=0.5)
    slower = fitted.on_slower_cores(2.0)
    assert (slower.control_s, slower.copy_bandwidth, slower.link_efficiency) == (0.02, 5e6, 0.5)
    est = simulate(plan, LINK, overheads=slower, depth=2)
    # the two copies and two control latencies take twice as long; the link's half rate stays
    assert est.ewtt == pytest.approx(2 * MODEL / 5e6 + MODEL / 0.5e6 + 2 * 0.02, rel=1e-6)
    assert fitted.on_slower_cores(0.5).on_slower_cores(2.0) == fitted
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="positive finite"):
            fitted.on_slower_cores(bad)


def test_writes_sharing_a_link_split_it_and_pay_the_flow_penalty():
    plan = _plan(2, 1, round_bytes=2 * MODEL)  # two trainers into one rollout link
    fair = simulate(plan, LINK, overheads=Overheads(), depth=2)
    assert fair.ewtt == pytest.approx(MODEL / 1e6, rel=1e-6)
    taxed = simulate(plan, LINK, overheads=Overheads(flow_penalty=0.25), depth=2)
    assert taxed.ewtt == pytest.approx(1.25 * MODEL / 1e6, rel=1e-6)


def test_a_third_arena_hides_control_latency_behind_the_link():
    slow = Cluster(gpus_per_node=1, inter_node_bandwidth=1e5, intra_node_bandwidth=1e9)
    plan = _plan(1, 4, round_bytes=4096)  # 17 rounds of about 40 ms on the links
    bare = simulate(plan, slow, overheads=Overheads(), depth=3).ewtt
    costs = {d: simulate(plan, slow, overheads=Overheads(control_s=0.005), depth=d).ewtt - bare
             for d in (2, 3)}
    # every round's steps hold 6 messages (send, forward, land: out and back)
    assert 0 < costs[3] < costs[2] < plan.num_rounds * 6 * 0.005


def test_workers_on_shared_cores_split_them():
    """One round, 1 -> 4 rollouts on free links: the trainer issues 4 writes alone, then the
    4 rollouts issue 3 forwards each at once; on shared cores those 12 writes' CPU is split."""
    plan = _plan(1, 4, round_bytes=2 * MODEL)
    assert plan.num_rounds == 1
    costs = Overheads(write_s=0.01)

    def ewtt(cpus: float) -> float:
        free = Cluster(gpus_per_node=1, inter_node_bandwidth=1e12, intra_node_bandwidth=1e12,
                       shared_cpus=cpus)
        return simulate(plan, free, overheads=costs, depth=2).ewtt

    own = ewtt(0)
    assert own == pytest.approx(4 * 0.01 + 3 * 0.01, rel=1e-4)
    assert ewtt(1) == pytest.approx(4 * 0.01 + 12 * 0.01, rel=1e-4)
    assert ewtt(2) == pytest.approx(4 * 0.01 + 6 * 0.01, rel=1e-4)
    assert ewtt(4) == pytest.approx(own, rel=1e-6)  # as many cores as busy workers
    with pytest.raises(ValueError, match="shared_cpus >= 0"):
        Cluster(gpus_per_node=1, inter_node_bandwidth=1, intra_node_bandwidth=1,
                shared_cpus=-1)


def test_the_controller_takes_its_share_of_the_cores():
    """1 -> 1 in three rounds, a step cost on the workers and a send cost on the controller:
    with as many shared cores as procs (trainer, rollout, controller) each runs at full speed;
    with one core fewer the controller's sends slow the workers down, which they would not
    if only the workers ran on the cores."""
    plan = _plan(1, 1, round_bytes=MODEL // 2)
    assert plan.num_rounds == 3

    def ewtt(cpus: float) -> float:
        free = Cluster(gpus_per_node=1, inter_node_bandwidth=1e12, intra_node_bandwidth=1e12,
                       shared_cpus=cpus)
        return simulate(plan, free, overheads=Overheads(stagger_s=0.01, step_s=0.02),
                        depth=2).ewtt

    assert ewtt(3) == pytest.approx(ewtt(100), rel=1e-9)
    assert ewtt(2) > ewtt(3) + 0.005


def test_overheads_and_depth_are_validated():
    with pytest.raises(ValueError, match="out of range"):
        Overheads(link_efficiency=1.5)
    with pytest.raises(ValueError, match="out of range"):
        Overheads(control_s=-1)
    with pytest.raises(ValueError, match="depth"):
        simulate(_plan(1, 1), LINK, overheads=Overheads(), depth=1)
    with pytest.raises(ValueError, match="at least one"):
        fit_overheads([])


def test_line_fits_through_the_origin_when_sizes_barely_vary():
    assert _line([100, 101, 102], [1.0, 1.01, 1.02]) == (0.0, pytest.approx(0.01))
    a, b = _line([0, 100, 200, 300], [1.0, 2.0, 3.0, 4.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.01)


def _synthetic_run(burst: int = 0) -> Run:
    """Spans of a 1 -> 1 transfer made by hand: pack at 1 GB/s, writes at 90% of the link,
    4 ms idle between rounds; with a token bucket of ``burst`` bytes (refilled in each idle
    gap) the first ``burst`` bytes of every write go unshaped."""
    plan = _plan(1, 1, round_bytes=MODEL // 4)
    rate = 1e6
    assert burst <= rate * 0.004
    spans, t = {("trainer", 0): [], ("rollout", 0): []}, 0.0
    for r in range(plan.num_rounds):
        n = int(plan.tables.send_bytes[0][r])
        pack_end = t + n / 1e9
        write_end = pack_end + (n - burst) / (0.9 * rate)
        spans[("trainer", 0)] += [("pack", r, int(t * 1e9), int(pack_end * 1e9)),
                                  ("receive", r, int(pack_end * 1e9), int(write_end * 1e9))]
        spans[("rollout", 0)].append(("assemble", r, int((write_end + 0.002) * 1e9),
                                      int((write_end + 0.002 + n / 1e9) * 1e9)))
        t = write_end + 0.004
    return Run(label="x", plan=plan, link_rate=rate, depth=2, spans=(spans,), ewtt_s=(t,),
               load="", link_burst=burst)


def test_fit_reads_copy_and_link_rates_off_synthetic_spans():
    run = _synthetic_run()
    oh = fit_overheads([run])
    assert oh.copy_bandwidth == pytest.approx(1e9, rel=0.01)
    assert oh.link_efficiency == pytest.approx(0.9, rel=0.01)
    assert math.isinf(oh.checksum_bandwidth)  # no gap between pack and write
    assert point_cluster(run).gpu_nic_bandwidth == run.link_rate


def test_the_link_rate_fit_does_not_count_a_refilled_burst_as_goodput():
    """Each write's first 2000 bytes pass unshaped after the link idled: the fit takes them
    out and still reads 90% (counting them, it read 1.0: more than the link can carry)."""
    oh = fit_overheads([_synthetic_run(burst=2000)])
    assert oh.link_efficiency == pytest.approx(0.9, rel=0.01)
    # Where every write fit its bucket, the links show no goodput: left at 1, not 0.
    whole = dataclasses.replace(_synthetic_run(), link_burst=1e9)
    assert fit_overheads([whole]).link_efficiency == 1.0


def test_a_block_quantizing_pack_costs_the_source_bytes_it_reads():
    """bf16 trainer, block-scaled FP8 rollout (32 x 32 blocks of a 64 x 64 weight), one round:
    the wire carries 1 byte per element and 4 per block, but the trainer's pack reads every
    bf16 element twice (amax, then values) and every block once more for its scale."""
    from weightbridge.types import scale_tensor
    reg = Region("w", (0, 0), (64, 64), (1, 1))
    trainer = SourceMap((ParamSpec("w", (64, 64), "bfloat16"),), (Piece(reg, "w", 0, (64, 1)),))
    grid = Region(scale_tensor("w"), (0, 0), (2, 2), (1, 1))
    rollout = SourceMap((ParamSpec("w", (64, 64), "float8_e4m3fn"),
                         ParamSpec("w_scale_inv", (2, 2), "float32")),
                        (Piece(reg, "w", 0, (64, 1), cast_from="bfloat16", block=(32, 32)),
                         Piece(grid, "w_scale_inv", 0, (2, 1), block=(32, 32))))
    plan = plan_transfer([(trainer, Placement("t0"))], [(rollout, Placement("r0", engine=0))],
                         round_bytes=1 << 20)
    wire = 64 * 64 + 4 * 4
    assert plan.num_rounds == 1 and plan.correspondence.nbytes == wire
    est = simulate(plan, LINK, overheads=Overheads(copy_bandwidth=1e7), depth=2)
    packed = 64 * 64 * 2 * 2 + 4 * 32 * 32 * 2  # values read twice, each scale's block once
    assert est.ewtt == pytest.approx(packed / 1e7 + wire / 1e6 + wire / 1e7, rel=1e-6)


def test_a_step_pays_fanout_for_every_worker_it_waits_for():
    """One round, nothing overlaps: the send step waits for every trainer, so its answers
    come in fanout_s x trainers later; the land step's join ends after the last assemble."""
    for trainers in (1, 2, 4):
        plan = _plan(trainers, 1, round_bytes=2 * MODEL)
        assert plan.num_rounds == 1
        base = simulate(plan, LINK, overheads=Overheads(control_s=0.01), depth=2).ewtt
        fan = simulate(plan, LINK, overheads=Overheads(control_s=0.01, fanout_s=0.003),
                       depth=2).ewtt
        assert fan - base == pytest.approx(0.003 * trainers, rel=1e-6)
    with pytest.raises(ValueError, match="out of range"):
        Overheads(fanout_s=-1)


def test_fit_takes_fanout_out_of_the_control_latency():
    """Spans of a 2 -> 1 transfer made by hand: the trainers send round after round with no
    gap (no step cost), and the rollout assembles each round two control latencies plus the
    send step's fanout (2 trainers) after its writes landed: given that fanout, the fit reads
    the control latency alone; without it, the fanout is counted in the latency."""
    plan = _plan(2, 1, round_bytes=MODEL // 4)
    control, fanout, rate = 0.002, 0.0005, 1e6
    spans, t = {("trainer", 0): [], ("trainer", 1): [], ("rollout", 0): []}, 0.0
    for r in range(plan.num_rounds):
        end = t
        for i in (0, 1):
            n = int(plan.tables.send_bytes[i][r])
            spans[("trainer", i)] += [("pack", r, int(t * 1e9), int(t * 1e9)),
                                      ("receive", r, int(t * 1e9), int((t + n / rate) * 1e9))]
            end = max(end, t + n / rate)
        start = end + 2 * control + 2 * fanout
        spans[("rollout", 0)].append(("assemble", r, int(start * 1e9), int(start * 1e9)))
        t = end
    run = Run(label="x", plan=plan, link_rate=rate, depth=100, spans=(spans,),
              ewtt_s=(t + 2 * control,), load="")
    assert fit_overheads([run], fanout_s=fanout).control_s == pytest.approx(control, rel=0.01)
    assert fit_overheads([run]).control_s == pytest.approx(control + fanout, rel=0.01)


def test_the_controller_sends_one_message_at_a_time():
    """One round, 1 -> 4 rollouts on free links, no cost but the stagger: the controller's
    9 messages (the trainer's send, 4 forwards, 4 lands) leave one after another, so the last
    assemble starts 8 staggers after the first write; the land's messages wait for the
    forward's even though its replies came in before."""
    plan = _plan(1, 4, round_bytes=2 * MODEL)
    assert plan.num_rounds == 1
    free = Cluster(gpus_per_node=1, inter_node_bandwidth=1e12, intra_node_bandwidth=1e12)
    est = simulate(plan, free, overheads=Overheads(stagger_s=0.01), depth=2)
    assert est.ewtt == pytest.approx(8 * 0.01, abs=1e-6)
    # with a control latency the queue drains while a step's replies travel: each step's
    # last message leaves 3 staggers after its first; 4 hops from the first write on
    est = simulate(plan, free, overheads=Overheads(stagger_s=0.01, control_s=0.1), depth=2)
    assert est.ewtt == pytest.approx(2 * 3 * 0.01 + 4 * 0.1, abs=1e-6)


def test_fit_reads_the_stagger_and_takes_it_out_of_the_control_latency():
    """Spans of a 1 -> 3 transfer made by hand: the rollouts assemble each round two control
    latencies after the trainer's writes landed, the k-th of them to start k staggers later
    (in no fixed order). The fit reads both apart; without the stagger, the median rollout's
    stagger is counted in the latency."""
    plan = _plan(1, 3, round_bytes=MODEL // 4)
    control, stagger, rate = 0.002, 0.001, 1e6
    spans = {("trainer", 0): [], **{("rollout", j): [] for j in range(3)}}
    t = 0.0
    for r in range(plan.num_rounds):
        end = t + int(plan.tables.send_bytes[0][r]) / rate
        spans[("trainer", 0)] += [("pack", r, int(t * 1e9), int(t * 1e9)),
                                  ("receive", r, int(t * 1e9), int(end * 1e9))]
        for k, j in enumerate((2, 0, 1) if r % 2 else (1, 2, 0)):
            start = int((end + 2 * control + k * stagger) * 1e9)
            spans[("rollout", j)].append(("assemble", r, start, start))
        t = end
    run = Run(label="x", plan=plan, link_rate=rate, depth=100, spans=(spans,),
              ewtt_s=(t + 2 * control + 2 * stagger,), load="")
    got = fit_overheads([run])
    assert got.stagger_s == pytest.approx(stagger, rel=0.01)
    assert got.control_s == pytest.approx(control, rel=0.01)
    assert fit_overheads([run], stagger=False).control_s == pytest.approx(
        control + stagger / 2, rel=0.01)


def test_runs_pickled_before_a_field_was_added_load_with_its_default(tmp_path, monkeypatch):
    """A `Run` pickled without `cpus` and the fields after it (as before they were added)
    loads with cpus 0, so its cluster has no shared cores, and one spawn; one that recorded
    them keeps them."""
    run = Run(label="x", plan=_plan(1, 1), link_rate=1e6, depth=2, spans=(), ewtt_s=(1.0,),
              load="", cpus=2)
    names = [f.name for f in dataclasses.fields(Run)]
    before = names[:names.index("cpus")]  # a slotted dataclass pickles its fields in order
    monkeypatch.setattr(Run, "__getstate__", lambda self: [getattr(self, n) for n in before])
    (tmp_path / "old.pkl").write_bytes(pickle.dumps([run]))  # as a Run without the field
    monkeypatch.undo()
    (tmp_path / "new.pkl").write_bytes(pickle.dumps([run]))
    for name, cpus in (("old.pkl", 0), ("new.pkl", 2)):
        (loaded,) = load_runs(tmp_path / name)
        assert loaded.cpus == cpus and point_cluster(loaded).shared_cpus == cpus
        assert loaded.spawns == 1


def test_a_run_on_several_sets_of_procs_drops_each_sets_first_update():
    """Each spawn's first update warms its fresh procs' caches: it does not count."""
    spans = tuple({("trainer", 0): [("pack", 0, k, k + 1)]} for k in range(6))
    run = Run(label="x", plan=_plan(1, 1), link_rate=1e6, depth=2, spans=spans,
              ewtt_s=(9.0, 1.0, 2.0, 9.0, 3.0, 4.0), load="", spawns=2)
    assert run.measured_ewtt_s == (1.0, 2.0, 3.0, 4.0) and run.measured_s == 2.5
    assert run.updates() == spans[1:3] + spans[4:]
    one = dataclasses.replace(run, spawns=1)
    assert one.measured_ewtt_s == (1.0, 2.0, 9.0, 3.0, 4.0) and one.updates() == spans[1:]
    # one update per spawn: each one counts
    assert dataclasses.replace(run, spawns=6).measured_ewtt_s == run.ewtt_s
    for spawns in (0, 4):
        with pytest.raises(ValueError, match="spawns of equal length"):
            dataclasses.replace(run, spawns=spawns)


def test_a_runs_core_speed_is_its_probes_median_interpreter_time():
    run = Run(label="x", plan=_plan(1, 1), link_rate=1e6, depth=2, spans=(), ewtt_s=(1.0,),
              load="")
    assert run.core_ms is None  # not recorded (runs before the probe)
    probed = dataclasses.replace(run, core_samples=((0, 0.6, 0.4), (0, 0.9, 0.5), (1, 0.5, 9.0)))
    assert probed.core_ms == 0.6
