"""A Monarch worker for one host: the controller attaches to it with `--attach-*` flags.

    export HYPERACTOR_MESH_DEFAULT_TRANSPORT=tcp://$HOST_ADDR:0
    python -m controller.worker tcp://$HOST_ADDR:4444

Runs until killed. The controller spawns one proc per GPU on it and stops them when done.
"""

import sys

from monarch.actor import run_worker_loop_forever

if __name__ == "__main__":
    if len(sys.argv) != 2 or "://" not in sys.argv[1]:
        raise SystemExit("usage: python -m controller.worker tcp://HOST:PORT")
    run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
