# %% [markdown]
# # WeightBridge on Monarch: a walkthrough
#
# Open this file as a notebook (VS Code, Jupyter with jupytext) or run it as a script:
#
#     .venv/bin/python examples/walkthrough.py
#
# It spawns a small trainer mesh and a small rollout mesh on this host, probes every worker by
# hand through the transfer group's control plane, shows the plan, moves two model versions
# with round-by-round RDMA writes, verifies them bit for bit, and shuts the meshes down.

# %%
import atexit

from controller.driver import MeshTransfer
from weightbridge.specs import RolloutSpec, TrainerSpec
from weightbridge import TransferConfig

trainer = TrainerSpec.parse("nodes=1,gpus=2,tp=2")  # a Megatron-like TP2 trainer
rollout = RolloutSpec.parse("engines=2,nodes=1,gpus=1,tp=1")  # two single-GPU engines
# 128 KiB rounds: a few rounds of the tiny model; a real model keeps the 8 MiB default.
mt = MeshTransfer(trainer, rollout, "tiny", config=TransferConfig(round_bytes=128 << 10))
mt.__enter__()  # spawns procs, actors and the group's agents; `mt.close()` in the last cell
atexit.register(mt.close)  # stops them if a cell fails (close() is idempotent)

# %% [markdown]
# ## Layout discovery, by hand
# Each actor built its rank of the demo model with a worker factory (`meshes.workers:tiny`)
# and registered it in the transfer group (`TransferGroup.worker`). Every call on a worker is
# a `PeerCall`, served by the group's agent on the worker's proc. `SOURCE_MAP` makes a worker
# probe its own `load_weights` and return a `SourceMap`: small values that travel to the
# controller. (`connect` below makes this same call.)

# %%
from weightbridge.driver import PeerCall, rollouts, trainers  # noqa: E402 (a notebook cell)

workers = trainers(mt.control) + rollouts(mt.control)
found = mt.control.call(workers, PeerCall.SOURCE_MAP)  # all at once
for worker, (smap, placement, spec) in zip(workers, found):
    engine = "" if placement.engine is None else f" engine {placement.engine}"
    print(f"{worker} on {placement.node}{engine}: {smap.summary().splitlines()[0]}")

# %% [markdown]
# ## Connect: correspond, plan, buffers
# `connect` probes every worker, plans the three-stage transfer on the controller, hands each
# worker its part of the plan and registers the round buffers. No weight moves yet.

# %%
plan = mt.connect()
print(plan.summary())

# %% [markdown]
# ## One update
# The trainers take a (stand-in) training step to version 1, the controller drives the rounds
# (the one round sequencer, `weightbridge.coordination.sequencer`), and every rollout compares
# checksums of its parameters with its own loader's result.

# %%
report = mt.update(1)
print(report.line())
assert not report.mismatched, report.mismatched

# %% [markdown]
# ## A second version, checked by hand
# The same plan moves every later version. The two engines are replicas of one policy: after
# the update, every rank of both holds the same bytes, and the same bytes as its own
# `load_weights` of version 2 (the `checksums` endpoint returns both digests per parameter).

# %%
report = mt.update(2)
print(report.line())
assert not report.mismatched, report.mismatched
digests = mt.rollouts.checksums.call(2).get()
for point, (live, own) in digests.items():
    print("rollout", dict(point), f"{len(live)} parameters,",
          "bit-identical to its own load_weights(v2)" if live == own else "MISMATCH")
    assert live == own
assert len({tuple(sorted(live.items())) for live, _ in digests.values()}) == 1

# %% [markdown]
# ## Shut down

# %%
mt.close()
print("meshes stopped")
