"""SenderAdapter and ReceiverAdapter: the three calls a user's RL loop makes (paper section 3.3).

    trainer workers                                 rollout workers
    ---------------                                 ---------------
    a = SenderAdapter(params, load_weights,         b = ReceiverAdapter(params, load_weights,
                      spec, rank=i, control=...,                      spec, rank=j, engine=e,
                      transport=..., config=c)                        engine_rank=k, ...)
    a.connect()                 # once, collective  (receivers are set up by rank-0's connect)
    loop: train step; a.send_weights(v)             loop: b.poll_requests(); inference step

Both sides share connect and the round sequencer (`weightbridge.coordination.session`) with the
controller-driven path: the rank-0 sender plays the controller's part. Round by round it has
the trainers pack and write, the receivers forward (EXTERNAL, INTERNAL) and land each round:
into their parameters (RS off) or into a host staging slot (RS on). The version protocol
(offers, relays, engine-consistent installs, staging slots) is the pure
`weightbridge.adapters.protocol`; this module adds bytes, locks and waits.

Where the calls of one adapter on another go is the ``control`` object (a
`weightbridge.coordination.control.ControlPlane`):
`weightbridge.coordination.local_control.LocalControl` calls the adapters of one process
directly (tests, demos); `weightbridge.mesh.control` turns each call into an actor endpoint
call and each write into an RDMA write.

A rollout worker lost mid-transfer raises `TransferFailed`; its engine leaves the group and
rank 0 re-plans without it (docs/failures.md).

Delta updates (``send_weights(v, changed=...)``, sync and RS modes) move only the tensors the
rollouts lack over a plan restricted to them: `sender_delta`, `delta`.

Modules: `base` (shared worker state and waits), `sender` (a trainer's worker; its
parts are components: `sender_delta.TrainerDelta` (``changes``),
`sender_membership.TrainerMembership` (``membership``) and, used on trainer 0,
`rank0.GroupSequencer` (``rank0``: every transfer, `recovery`, the rank-0 half of
`sender_delta`), whose `leader.GroupLeader` owns the group's state), `receiver`; the protocol
itself is `protocol`.

Typical usage: see docs/integration.md and tests/test_adapters.py.
"""

from weightbridge.errors import TransferFailed
from weightbridge.adapters.receiver import ReceiverAdapter
from weightbridge.adapters.sender import SenderAdapter

__all__ = ["ReceiverAdapter", "SenderAdapter", "TransferFailed"]
