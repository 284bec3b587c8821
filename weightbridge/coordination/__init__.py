"""Coordination (paper section 3): one connect and one round sequencer for every path.

`control` declares the two protocols a transfer group runs on (`ControlPlane`, `Transport`)
and the `PeerCall`s workers serve; `session` is connect and update, once; `sequencer` issues
an update's rounds with ``depth`` in flight; `worker.TransferWorker` is one rank's part.
`sender` / `receiver` (re-exported by `adapters`) are the user-facing ``connect`` /
``send_weights`` / ``poll_requests`` with the pure version and staging state machines of
`protocol`; `local` and `local_control` run a group in one process.
"""
