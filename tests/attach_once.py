"""Attach to workers through Monarch alone (no handshake probe first), bounded: prints ATTACHED
or REFUSED: <why> (exit 3). Run as a script with the HYPERACTOR_TLS_* files and the transport in
the environment; tests/test_cluster_tls.py uses it to show the workers' and the controller's own
TLS channels refuse a foreign peer, not only `controller.launch.probe_workers`.

    python tests/attach_once.py tls://10.77.0.2:4444 10   # addresses, timeout in seconds
"""

import sys

from controller.launch import WorkerRefused, attach_procs
from controller.security import resolve

if __name__ == "__main__":
    addresses, timeout_s = sys.argv[1].split(","), float(sys.argv[2])
    security = resolve(tls_dir=None, ca=None, cert=None, key=None, insecure=False,
                       name="controller")  # the HYPERACTOR_TLS_* files of the environment
    try:
        owner, _ = attach_procs(addresses, gpus=1, name="probe_off", security=security,
                                timeout_s=timeout_s, probe=False)
    except WorkerRefused as e:
        print(f"REFUSED: {e}", flush=True)
        raise SystemExit(3)
    owner.stop().get(timeout=60)
    print("ATTACHED", flush=True)
