"""Estimate end-to-end weight transfer time (EWTT) of a plan, of Eq. (1), and of two baselines.

Link model: each GPU owns ``1 / gpus_per_node`` of its node's RDMA bandwidth, separately in each
direction, and ``intra_node_bandwidth`` of NVLink per direction. A stage of a round lasts as long
as its busiest link: max over workers of (bytes out, bytes in) / bandwidth.

Pipeline model (two buffers per worker): a round's two network stages form one phase that lasts
as long as its busiest NIC over both (forwarding of round r overlaps receiving of round r + 1 on
the other buffer, so in steady state each NIC streams its own bytes); the network runs rounds in
order. NVLink runs INTERNAL(r) after the network phase of round r. Round r also waits until
INTERNAL(r - 2) has finished, because it reuses that round's buffers. EWTT is the end of the last
INTERNAL. Not modelled: pack/assemble kernels, RDMA latency, control messages, and the chunk
latency before a relay can start forwarding.

Baselines, on the same layouts and links, with no round overheads (so they are optimistic):
- broadcast: every trainer's unique elements go to one head GPU (trainer 0), then the full model
  is broadcast to every rollout worker (each node receives M once; NVLink fans it out);
- P2P: every rollout worker pulls each element it needs from one holder (the first), so a
  trainer sends its data once per rollout worker that needs it.

Typical usage::

    est = simulate(plan, Cluster(gpus_per_node=8, inter_node_bandwidth=400e9,
                                 intra_node_bandwidth=450e9))
    print(est.ewtt, est.ideal, est.ratio)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightbridge.config import DEFAULT_DEPTH
from weightbridge.planning.plan import TransferPlan
from weightbridge.planning.route import INTERNAL
from weightbridge.planning.ideal import eq1
from weightbridge.simulation.timeline import Overheads, timeline_ewtt


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """The links a simulated transfer runs over.

    Example (the paper's testbed): ``Cluster(gpus_per_node=8, inter_node_bandwidth=400e9,
    intra_node_bandwidth=450e9)``
    """

    gpus_per_node: int
    """GPUs per node; each GPU gets ``1 / gpus_per_node`` of its node's network bandwidth."""
    inter_node_bandwidth: float
    """Bytes per second a node sends (and, separately, receives) over RDMA."""
    intra_node_bandwidth: float
    """Bytes per second a GPU sends (and, separately, receives) over NVLink."""
    nic_bandwidth: float | None = None
    """Bytes per second one GPU's own NIC sends (and receives); None: its share of the node,
    ``inter_node_bandwidth / gpus_per_node``. An emulated host whose procs share one link:
    the link's rate (any proc may use all of it)."""
    link_burst_bytes: float = 0.0
    """Bytes a node's link (and a GPU's NIC) may send unshaped after idling: a token bucket,
    as `tc tbf` shapes the emulated cluster's links (`controller.cluster.link_burst_bytes`);
    0: none, the link's rate from the first byte (a real link). The calibrated model only."""
    shared_cpus: float = 0.0
    """CPU cores that every worker's steps and the controller's sends share: the emulated
    cluster runs all its hosts' procs on one machine (`os.cpu_count()` there); 0: every proc
    its own CPU (a real cluster). The calibrated model only (`weightbridge.simulation.timeline`)."""

    def __post_init__(self) -> None:
        if (self.gpus_per_node < 1 or self.inter_node_bandwidth <= 0
                or self.intra_node_bandwidth <= 0
                or (self.nic_bandwidth is not None and self.nic_bandwidth <= 0)
                or not self.link_burst_bytes >= 0 or not self.shared_cpus >= 0):
            raise ValueError(f"{self} needs gpus_per_node >= 1, positive bandwidths, "
                             f"link_burst_bytes >= 0 and shared_cpus >= 0")

    @property
    def gpu_nic_bandwidth(self) -> float:
        """Bytes per second one GPU sends (and receives) over RDMA."""
        return (self.nic_bandwidth if self.nic_bandwidth is not None
                else self.inter_node_bandwidth / self.gpus_per_node)


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Simulated end-to-end weight transfer times (EWTT), in seconds.

    Example: ``Estimate(ewtt=0.171, ideal=0.160, broadcast=1.35, p2p=0.64, num_rounds=8)``
    """

    ewtt: float
    """The plan, rounds pipelined over two buffers per worker."""
    ideal: float
    """Eq. (1): max(M / B_T, max over rollout nodes of M_v / B_v)."""
    broadcast: float
    """Baseline: gather the model on one trainer, broadcast all of it to every rollout worker."""
    p2p: float
    """Baseline: every rollout worker pulls each element from one owner (the first holder)."""
    num_rounds: int
    """Rounds in the plan."""

    @property
    def ratio(self) -> float:
        """ewtt / ideal."""
        return self.ewtt / self.ideal



def simulate(plan: TransferPlan, cluster: Cluster, *, overheads: Overheads | None = None,
             depth: int = DEFAULT_DEPTH) -> Estimate:
    """Simulated EWTT of ``plan`` on ``cluster``, with the ideal and the two baselines.

    Keyword Args:
        overheads: Measured step costs (`weightbridge.simulation.calibrate.fit_overheads`):
            EWTT then comes from the event-driven model of an update
            (`weightbridge.simulation.timeline`); None: the no-overhead pipelined model.
        depth: Round arenas per worker (`TransferConfig.depth`); the calibrated model only.
    """
    ewtt = (_pipelined(plan, cluster) if overheads is None else
            timeline_ewtt(plan, cluster, overheads, depth))
    return Estimate(ewtt=float(ewtt), ideal=float(ideal_ewtt(plan, cluster)),
                    broadcast=float(_broadcast(plan, cluster)), p2p=float(_p2p(plan, cluster)),
                    num_rounds=plan.num_rounds)


def ideal_ewtt(plan: TransferPlan, cluster: Cluster) -> float:
    """Eq. (1): max(M / B_T, max over rollout nodes v of M_v / B_v)."""
    bw = cluster.inter_node_bandwidth
    return eq1(plan, trainer_node_bandwidth=bw, rollout_node_bandwidth=bw)


def _pipelined(plan: TransferPlan, cluster: Cluster) -> float:
    t = plan.tables
    num_rounds, num_workers = t.num_rounds, len(plan.trainers) + len(plan.rollouts)
    if num_rounds == 0:
        return 0.0
    nic = cluster.gpu_nic_bandwidth
    rnd = t.round
    nbytes = t.nbytes.astype(np.float64)

    def busiest(mask: np.ndarray, bw: float) -> np.ndarray:
        """[R] seconds of the busiest link end (egress or ingress) among ``mask`` writes."""
        worst = np.zeros(num_rounds)
        for ends in (t.src[mask], t.dst[mask]):
            load = np.bincount(rnd[mask] * num_workers + ends, weights=nbytes[mask],
                               minlength=num_rounds * num_workers)
            worst = np.maximum(worst, load.reshape(num_rounds, num_workers).max(1) / bw)
        return worst

    network = busiest(t.stage != INTERNAL, nic)
    internal = busiest(t.stage == INTERNAL, cluster.intra_node_bandwidth)
    net_free = nvl_free = 0.0
    internal_end = [0.0] * num_rounds
    for r in range(num_rounds):
        buffer_free = internal_end[r - 2] if r >= 2 else 0.0
        network_end = max(net_free, buffer_free) + network[r]
        net_free = network_end
        internal_end[r] = max(network_end, nvl_free) + internal[r]
        nvl_free = internal_end[r]
    return internal_end[-1]


def _broadcast(plan: TransferPlan, cluster: Cluster) -> float:
    corr = plan.correspondence
    model = corr.nbytes
    nic = cluster.gpu_nic_bandwidth
    head = plan.trainers[0].node
    # Gather: bytes the head does not hold arrive over NVLink (same node) or its NIC.
    local = remote = 0
    for o in corr.overlaps:
        if 0 in o.holders:
            continue
        if any(plan.trainers[h].node == head for h in o.holders):
            local += o.nbytes
        else:
            remote += o.nbytes
    gather = max(local / cluster.intra_node_bandwidth, remote / nic)
    # Broadcast: the head GPU's NIC sends M; every rollout node takes in M (pipelined).
    spread = model / min(nic, cluster.inter_node_bandwidth, cluster.intra_node_bandwidth)
    return gather + spread


def _p2p(plan: TransferPlan, cluster: Cluster) -> float:
    corr = plan.correspondence
    nic = cluster.gpu_nic_bandwidth
    sent = np.zeros(len(plan.trainers))
    received = np.zeros(len(plan.rollouts))
    for o in corr.overlaps:
        sent[o.holders[0]] += o.nbytes * len(o.needers)
        received[list(o.needers)] += o.nbytes
    return max(sent.max() / nic, received.max() / nic)
