"""simulate: pipelined EWTT against Eq. (1) and the two baselines."""

import pytest

from planning_layouts import one_tensor_plan
from weightbridge import Cluster, simulate

CLUSTER = Cluster(gpus_per_node=1, inter_node_bandwidth=100.0, intra_node_bandwidth=1000.0)


def test_ideal_is_eq_1():
    est = simulate(one_tensor_plan(2, 3), CLUSTER)
    model = 256 * 64 * 4
    assert est.ideal == pytest.approx(max(model / 200.0, model / 100.0))


@pytest.mark.parametrize("num_trainers,num_nodes", [(1, 1), (2, 4), (4, 2), (1, 8)])
def test_plan_is_within_5_percent_of_ideal(num_trainers, num_nodes):
    est = simulate(one_tensor_plan(num_trainers, num_nodes, round_bytes=2048), CLUSTER)
    assert est.ideal <= est.ewtt <= 1.05 * est.ideal, est


def test_p2p_pays_the_single_source_bottleneck():
    est = simulate(one_tensor_plan(1, 8), CLUSTER)
    assert est.p2p == pytest.approx(8 * est.ideal)
    assert est.ewtt < est.p2p / 4


def test_broadcast_moves_the_whole_model_through_the_head():
    est = simulate(one_tensor_plan(2, 2), CLUSTER)
    model = 256 * 64 * 4
    assert est.broadcast >= model / 100.0
    assert est.ratio == est.ewtt / est.ideal


def test_replicas_inside_a_node_share_its_nic_and_rounds_hide_nvlink():
    cluster = Cluster(gpus_per_node=4, inter_node_bandwidth=100.0, intra_node_bandwidth=100.0)
    one = simulate(one_tensor_plan(4, 2, 4, round_bytes=64 << 10, trainers_per_node=4), cluster)
    many = simulate(one_tensor_plan(4, 2, 4, round_bytes=2048, trainers_per_node=4), cluster)
    assert one.num_rounds <= 2 and many.num_rounds > 8
    assert many.ewtt < one.ewtt
    assert many.ewtt <= 1.1 * many.ideal, many


def test_cluster_validates_its_numbers():
    with pytest.raises(ValueError, match="positive"):
        Cluster(gpus_per_node=8, inter_node_bandwidth=0, intra_node_bandwidth=1)
