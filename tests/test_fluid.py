"""The update model's fluid network: max-min shares, unlimited resources, token buckets.
Pure, no Monarch."""

import math

import numpy as np
import pytest

from weightbridge import Cluster, Placement, SourceMap, plan_transfer, simulate
from weightbridge.simulation.fluid import FluidNetwork
from weightbridge.simulation.timeline import Overheads
from weightbridge.types import ParamSpec, Piece, Region


def _finish(net: FluidNetwork) -> float:
    """Runs ``net`` until every flow ended; the seconds it took."""
    t = 0.0
    while net.flows:
        dt = net.next_event()
        net.advance(dt)
        t += dt
    return t


def test_an_unlimited_resource_does_not_cap_the_flows_that_cross_it():
    """Regression: every flow lists four resources, padded with one unlimited resource; the
    fill took that resource for saturated at the first level (inf <= 1e-9 x inf), so a flow
    on a fast link (NVLink) was held to the share of a slow one (the emulated network)."""
    net = FluidNetwork(np.array([1.0, 1e9, math.inf]), np.array([True, True, False]), 0.0)
    net.add((0, 2, 2, 2), 10, None)
    net.add((1, 2, 2, 2), 10, None)
    assert net.rate == {0: 1.0, 1: 1e9}


def test_a_token_bucket_sends_its_burst_unshaped_then_the_rate():
    net = FluidNetwork(np.array([1e6, math.inf]), np.array([True, False]), 0.0,
                       burst=np.array([1e5, 0.0]))
    net.add((0, 1), 3e5, None)
    assert _finish(net) == pytest.approx(0.2, rel=1e-4)  # 1e5 at once, then 2e5 at 1e6 B/s
    assert net.tokens[0] == 0


def test_the_bucket_refills_at_the_rate_while_the_link_idles():
    net = FluidNetwork(np.array([1e6, math.inf]), np.array([True, False]), 0.0,
                       burst=np.array([1e5, 0.0]))
    net.add((0, 1), 1e5, None)
    _finish(net)
    net.advance(0.03)  # idle: 3e4 tokens back
    assert net.tokens[0] == pytest.approx(3e4, rel=1e-4)
    net.add((0, 1), 1e5, None)
    assert _finish(net) == pytest.approx(0.07, rel=1e-4)
    net.advance(1.0)  # a long idle fills the bucket, no further
    assert net.tokens[0] == pytest.approx(1e5)


def _plan(num_rollouts: int, round_bytes: int):
    reg = Region("w", (0, 0), (256, 64), (1, 1))
    smap = SourceMap((ParamSpec("w", (256, 64), "float32"),), (Piece(reg, "w", 0, (64, 1)),))
    return plan_transfer([(smap, Placement("t0"))],
                         [(smap, Placement(f"r{i}", engine=i)) for i in range(num_rollouts)],
                         round_bytes=round_bytes)


def test_rounds_that_fit_the_bucket_beat_the_rate_when_the_link_idles_between_them():
    """Control messages leave the link idle between rounds; a bucket of a round's bytes
    refills in that time (at 10 ms a hop, 1e4 B of a 1e6 B/s link), so a round of 8 KiB
    crosses in well under its 8 ms: EWTT falls, and with no bucket it does not."""
    plan = _plan(1, round_bytes=8 << 10)
    oh = Overheads(control_s=0.01)
    shaped = Cluster(gpus_per_node=1, inter_node_bandwidth=1e6, intra_node_bandwidth=1e9)
    bucket = Cluster(gpus_per_node=1, inter_node_bandwidth=1e6, intra_node_bandwidth=1e9,
                     link_burst_bytes=16 << 10)
    slow = simulate(plan, shaped, overheads=oh, depth=2).ewtt
    fast = simulate(plan, bucket, overheads=oh, depth=2).ewtt
    link = plan.correspondence.nbytes / 1e6
    assert fast < slow - 0.5 * link
    with pytest.raises(ValueError, match="link_burst_bytes"):
        Cluster(gpus_per_node=1, inter_node_bandwidth=1e6, intra_node_bandwidth=1e9,
                link_burst_bytes=-1)
