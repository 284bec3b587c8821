"""The toy task: continue a prompt of random tokens; a generated token earns reward when it is
a multiple of `TARGET_EVERY`. A random policy scores about 1/8; the best one scores 1.

Pure functions of token ids (no engine, no Monarch): prompts per step, rewards, and GRPO's
group-relative advantages.
"""

from __future__ import annotations

import torch

VOCAB = 120
TARGET_EVERY = 8
PROMPT_LEN, COMPLETION_LEN = 4, 8


def prompts(step: int, count: int) -> list[list[int]]:
    """``count`` prompts of `PROMPT_LEN` random tokens, fixed by ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(2, VOCAB, (count, PROMPT_LEN), generator=gen).tolist()


def reward(completion: list[int]) -> float:
    """The fraction of generated tokens that are multiples of `TARGET_EVERY`."""
    if not completion:
        raise ValueError("an empty completion has no reward: generate at least one token")
    return sum(t % TARGET_EVERY == 0 for t in completion) / len(completion)


def advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward against its group's mean, over the group's std.

    ``rewards`` is [prompts, samples per prompt]; a group whose samples all scored alike
    gets zeros (nothing to learn from it).
    """
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples >= 2], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)
