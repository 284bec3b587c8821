"""SenderAdapter and ReceiverAdapter: the three calls a user's RL loop makes (paper section 3.3).

    trainer workers                                 rollout workers
    ---------------                                 ---------------
    a = SenderAdapter(params, load_weights,         b = ReceiverAdapter(params, load_weights,
                      spec, rank=i, control=...,                      spec, rank=j, engine=e,
                      transport=..., options=o)                       engine_rank=k, ...)
    a.connect()                 # once, collective  (receivers are set up by rank-0's connect)
    loop: train step; a.send_weights(v)             loop: b.poll_requests(); inference step

Both sides share the planner (`plan_transfer`), `WorkerExecutor` and the transport with the
controller-driven path. The rank-0 sender sequences every transfer (as the controller does):
round by round it has the trainers pack and write, the receivers forward (EXTERNAL, INTERNAL)
and land each round: into their parameters (RS off) or into a host staging slot (RS on). The
version protocol (offers, relays, engine-consistent installs, staging slots) is the pure
`weightbridge.coordination`; this module adds bytes, locks and waits.

Where the calls of one adapter on another go is the ``control`` object: `weightbridge.
adapters_local.LocalControl` calls the adapters of one process directly (tests, demos); a mesh
control plane turns each call into an actor endpoint call. Transport: ``write(peer, range, src)``
and ``wait(futures)``; `adapters_local.LocalTransport` copies in process.

A rollout worker lost mid-transfer raises `TransferFailed`; its engine leaves the group and
rank 0 re-plans without it (docs/integration.md, "Failures").

Modules: `adapter_base` (options, shared worker state, group set-up), `sender`, `receiver`;
the protocol itself is `coordination`.

Typical usage: see docs/integration.md and tests/test_adapters.py.
"""

from weightbridge.adapter_base import AdapterOptions, TransferFailed, setup_group
from weightbridge.receiver import ReceiverAdapter
from weightbridge.sender import SenderAdapter

__all__ = ["AdapterOptions", "ReceiverAdapter", "SenderAdapter", "TransferFailed",
           "setup_group"]
