"""The single controller: one Monarch script that owns a trainer mesh and a rollout mesh and
drives every update (docs/controller.md).

`MeshTransfer` (`controller.driver`) spawns (or is given) both proc meshes, builds each rank
with a worker factory, connects (probe, plan, buffers) and per update runs the round
sequencer in any of the four sync modes, then verifies the rollouts; engines join and leave
between updates. The package also holds the CLI (``python -m controller``), the multi-host
launch and its TLS files (`controller.launch`, `controller.security`, `controller.certs`,
``python -m controller.worker``), the emulated cluster (`controller.cluster`) and the
baselines measured against (`controller.baselines`).

Typical usage::

    from controller import MeshTransfer
    with MeshTransfer(TrainerSpec.parse("nodes=1,gpus=2,tp=2"),
                      RolloutSpec.parse("engines=2,nodes=1,gpus=1"), "tiny") as mt:
        mt.connect()
        print(mt.update(1).line())

``MeshTransfer`` is imported on first use: importing this package does not start Monarch,
because the CLI and the worker must set Monarch's TLS variables before it loads
(`controller.security`).
"""

from __future__ import annotations

__all__ = ["MeshTransfer"]


def __getattr__(name: str):
    if name == "MeshTransfer":  # lazy: controller.driver imports Monarch
        from controller.driver import MeshTransfer

        return MeshTransfer
    raise AttributeError(f"module 'controller' has no attribute {name!r}")
