"""Baselines WeightBridge is measured against, on the same procs, model and links.

- `controller.baselines.dist`: what users run today, through ``torch.distributed`` (gloo):
  `GlooBroadcast` (Miles / verl / OpenRLHF: collect on trainer 0, bucketed broadcast,
  ``load_weights`` on every rollout), `RingBroadcast` (the same relayed along a ring, as NCCL
  does) and `BucketedP2P` (checkpoint-engine's pattern: fixed-size
  buckets of full tensors with per-tensor metadata, owner to each rollout). Their pure
  planning is `controller.baselines.plans`, their actors `controller.baselines.members`.
- `controller.baselines.same_plane`: ablations on WeightBridge's own data plane (Monarch RDMA)
  and plans: `Broadcast` (gather to a head, one write per rollout, no relay) and `p2p_plan`
  (every forward re-sourced from its trainer); only the traffic pattern differs.
"""

from controller.baselines.dist import BucketedP2P, GlooBroadcast, RingBroadcast
from controller.baselines.same_plane import (FLAT_SPEC, HEAD_SPEC, Broadcast, BroadcastRollout,
                                             HeadActor, p2p_plan)

__all__ = ["FLAT_SPEC", "HEAD_SPEC", "Broadcast", "BroadcastRollout", "BucketedP2P",
           "GlooBroadcast", "HeadActor", "RingBroadcast", "p2p_plan"]
