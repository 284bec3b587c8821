"""A rollout rank's forward pass reads the weights it holds."""

import torch

from meshes.forward import rank_forward
from meshes.qwen3_moe import SIZES, RolloutShard, checkpoint_spec

CONFIG = SIZES["tiny"]


def _loaded(shard: RolloutShard, seed: int) -> RolloutShard:
    gen = torch.Generator().manual_seed(seed)
    shard.load_weights((t.name, (torch.randn(t.shape, generator=gen) * 0.05).bfloat16())
                       for t in checkpoint_spec(CONFIG).tensors)
    return shard


def test_forward_gives_local_vocab_logits_and_follows_the_weights():
    tokens = torch.randint(0, CONFIG.vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    shard = _loaded(RolloutShard(CONFIG, 2, 1, 2, 1), seed=0)
    first = rank_forward(shard, tokens)
    assert first.shape == (2, 5, shard.params["lm_head.weight"].shape[0])
    assert torch.isfinite(first).all()
    assert torch.equal(first, rank_forward(shard, tokens))
    # a new version changes the logits, and the local experts take part
    second = rank_forward(_loaded(shard, seed=1), tokens)
    assert not torch.equal(first, second)
    shard.params["model.layers.1.mlp.experts.w2_weight"].zero_()
    assert not torch.equal(second, rank_forward(shard, tokens))
