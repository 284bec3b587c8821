# %% [markdown]
# # WeightBridge on Monarch: a walkthrough
#
# Open this file as a notebook (VS Code, Jupyter with jupytext) or run it as a script:
#
#     .venv/bin/python examples/walkthrough.py
#
# It spawns a small trainer mesh and a small rollout mesh on this host, calls the probe
# endpoints by hand, shows the plan, moves one model version with round-by-round RDMA writes,
# verifies it bit for bit, and shuts the meshes down.

# %%
import atexit

from controller.driver import MeshTransfer
from meshes.spec import RolloutSpec, TrainerSpec

trainer = TrainerSpec.parse("nodes=1,gpus=2,tp=2")  # a Megatron-like TP2 trainer
rollout = RolloutSpec.parse("engines=2,nodes=1,gpus=1,tp=1")  # two single-GPU engines
mt = MeshTransfer(trainer, rollout, "tiny", round_bytes=128 << 10)
mt.__enter__()  # spawns both meshes; `mt.close()` in the last cell stops them
atexit.register(mt.close)  # and this stops them if a cell fails (close() is idempotent)

# %% [markdown]
# ## Layout discovery, by hand
# Every actor probes its own `load_weights` and returns a `SourceMap`: the endpoint call is the
# whole integration. The maps are small values that travel to the controller.

# %%
for point, smap in mt.trainers.source_map.call().get().items():
    print("trainer", dict(point), smap.summary())
for point, smap in mt.rollouts.source_map.call().get().items():
    print("rollout", dict(point), smap.summary())

# %% [markdown]
# ## Connect: correspond, plan, buffers
# `connect` gathers the maps, plans the three-stage transfer on the controller, hands each
# actor its part of the plan and registers the round buffers. No weight moves yet.

# %%
plan = mt.connect()
print(plan.summary())

# %% [markdown]
# ## One update
# The trainers take a (stand-in) training step to version 1, the controller drives the rounds,
# and every rollout compares checksums of its parameters with its own loader's result.

# %%
report = mt.update(1)
print(report.line())
assert not report.mismatched, report.mismatched

# %% [markdown]
# The rollouts generate with the weights they just received: each rank runs its share of a
# forward pass (no collectives here) and returns its greedy tokens.

# %%
generated = mt.rollouts.generate_step.call(seed=0).get()
for point, tokens in generated.items():
    print("rollout", dict(point), "generate_step ->", tokens)
# the two engines are replicas of one policy version: they generate the same tokens
assert len({tuple(tokens) for tokens in generated.values()}) == 1

# %% [markdown]
# ## Shut down

# %%
mt.close()
print("meshes stopped")
