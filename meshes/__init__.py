"""The demo's model and actors: what the controller, the examples and the tests run on meshes.

- `meshes.qwen3_moe`: a Qwen3-MoE-shaped model family (pure torch) and its shards in trainer
  layouts (Megatron-like TP/EP/PP, FSDP flat shards) and the rollout layout (fused qkv and
  gate_up, stacked experts, padded vocabulary), each with its own ``load_weights``;
  `meshes.fp8_rollout` a block-scaled FP8 rollout of it.
- `meshes.spec`: `trainer_shard` (mesh specs are `weightbridge.specs`); `meshes.workers`:
  the demo model as worker factories (``meshes.workers:tiny``), resolved by `meshes.factories`.
- `meshes.actors`: the controller's thin `TrainerActor` / `RolloutActor`;
  `meshes.adapter_actors`: a user's own sync actors with the adapters inside (`RLTrainer`,
  `RLRollout`, as in docs/integration.md); `meshes.forward`: a rollout rank's forward pass;
  `meshes.device`: each proc's GPU binding.

Nothing here is part of the library (`weightbridge`): it is the model and the actors the
library is demonstrated and tested with. Your own model comes in as a worker factory
(docs/your-model.md).

Typical usage::

    from meshes.qwen3_moe import SIZES, RolloutShard, checkpoint_spec
    shard = RolloutShard(SIZES["tiny"], 2, 0, 1, 0)      # TP rank 0 of 2
    shard.load_weights(checkpoint)                       # (name, tensor) pairs of the spec
"""
