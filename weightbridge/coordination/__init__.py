"""Coordination (paper section 3): one connect and one round sequencer for every path.

`control` declares the two protocols a transfer group runs on (`ControlPlane`, `Transport`)
and the `PeerCall`s workers serve; `session` is connect and update, once; `sequencer` issues
an update's rounds with ``depth`` in flight; `worker.TransferWorker` is one rank's part.
`leader.GroupLeader` owns a connected group's state (with its staging-slot ledger, `slots`,
and the delta log, `delta`); `local` and `local_control` run a group in one process. The
user-facing ``connect`` / ``send_weights`` / ``poll_requests`` on this core are
`weightbridge.adapters`.
"""
