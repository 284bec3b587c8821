"""The links' own reference (`benchmarks/plain_tcp.py`): a plan's bytes between hosts, and plain TCP
carrying them on the emulated cluster."""

import subprocess

import pytest

from benchmarks.plain_tcp import Pipe, measure, pipes
from controller.cluster import NS_PREFIX, EmulatedCluster, host_address, unavailable_reason
from tests.planning_layouts import one_tensor_plan
from weightbridge.types.plans import Stage

REASON = unavailable_reason()


def test_pipes_carry_every_byte_between_hosts_and_none_inside_one():
    # 2 trainers on one node, 3 rollout nodes of 2 engines: RECEIVE and EXTERNAL cross hosts,
    # INTERNAL stays inside a node.
    plan = one_tensor_plan(2, 3, workers_per_node=2, trainers_per_node=2)
    by_stage = {s: sum(t.nbytes for r in plan.rounds for t in r.stage(s)) for s in Stage}
    assert by_stage[Stage.INTERNAL] > 0
    flows = pipes(plan)
    assert sum(p.nbytes for p in flows if not p.forwards) == by_stage[Stage.RECEIVE]
    assert sum(p.nbytes for p in flows if p.forwards) == by_stage[Stage.EXTERNAL]
    assert all(p.src_host != p.dst_host for p in flows)
    assert {p.src_host for p in flows if not p.forwards} == {0}  # the trainers' node first
    assert {p.dst_host for p in flows} == {1, 2, 3}
    assert len({(p.src, p.dst) for p in flows}) == len(flows)  # one pipe per pair of workers


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
@pytest.mark.emulated_cluster
def test_plain_tcp_carries_a_relayed_pattern_no_faster_than_the_links():
    # One trainer worker sends 1 MB to each of two rollout hosts; each forwards it to the
    # other as it lands. Each rollout host receives 2 MB over its 100 Mbit/s link.
    mb = 1_000_000
    flows = [Pipe(0, 0, 1, 1, mb, False), Pipe(0, 0, 2, 2, mb, False),
             Pipe(1, 1, 2, 2, mb, True), Pipe(2, 2, 1, 1, mb, True)]
    with EmulatedCluster(3, link_mbit=100, start_workers=False):
        seconds = measure(flows, [host_address(i) for i in range(3)], NS_PREFIX)
    line_rate = 2 * mb / (100e6 / 8)  # 0.16 s
    assert 0.9 * line_rate < seconds < 10 * line_rate
    ps = subprocess.run(["pgrep", "-f", "plain_tcp.py --node"], capture_output=True, text=True)
    assert ps.stdout == ""  # every node process is gone


def test_measure_refuses_no_pipes_and_hosts_without_addresses_before_starting_anything():
    with pytest.raises(ValueError, match="writes nothing between hosts"):
        measure([], ["10.77.0.2"], NS_PREFIX)
    with pytest.raises(ValueError, match="use 3 hosts but 2 addresses"):
        measure([Pipe(0, 0, 1, 2, 10, False)], ["10.77.0.2", "10.77.0.3"], NS_PREFIX)
