"""Eq. (1) of the paper: the ideal transfer time of a plan, bounded by trainer-node egress and
by the busiest rollout node's ingress. The drivers report every update against it; the
simulator (`weightbridge.simulation`) estimates how close a plan's rounds come to it.
"""

from __future__ import annotations

from weightbridge.planning.plan import TransferPlan


def eq1(plan: TransferPlan, *, trainer_node_bandwidth: float,
        rollout_node_bandwidth: float) -> float:
    """Eq. (1) with separate link rates (bytes/s): trainer-node egress, rollout-node ingress.

    M / B_T with B_T = trainer nodes x ``trainer_node_bandwidth``; M_v (the unique bytes the
    workers of rollout node v need) / ``rollout_node_bandwidth`` for every rollout node.
    """
    if trainer_node_bandwidth <= 0 or rollout_node_bandwidth <= 0:
        raise ValueError(f"bandwidths must be positive, got {trainer_node_bandwidth} and "
                         f"{rollout_node_bandwidth} bytes/s")
    corr = plan.correspondence
    trainer_nodes = len({p.node for p in plan.trainers})
    node_need: dict[str, int] = {}
    for o in corr.overlaps:
        for node in {plan.rollouts[w].node for w in o.needers}:
            node_need[node] = node_need.get(node, 0) + o.nbytes
    return max(corr.nbytes / (trainer_nodes * trainer_node_bandwidth),
               max(node_need.values(), default=0) / rollout_node_bandwidth)
