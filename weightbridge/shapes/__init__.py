"""Shape-only source maps at the paper's scale: real model shapes, framework-style layouts.

Typical usage::

    from weightbridge.shapes import TABLE_2, PAPER_CLUSTER, workers
    trainers, rollouts = workers(TABLE_2[3])     # Kimi-K2, 256 + 256 workers
"""

from weightbridge.shapes.deployments import PAPER_CLUSTER, TABLE_2, Deployment, workers
from weightbridge.shapes.layouts import megatron_maps, sglang_maps
from weightbridge.shapes.models import (
    KIMI_K2,
    MOONLIGHT_16B_A3B,
    QWEN3_235B_A22B,
    QWEN3_30B_A3B,
    ModelConfig,
    checkpoint,
)

__all__ = ["KIMI_K2", "MOONLIGHT_16B_A3B", "PAPER_CLUSTER", "QWEN3_235B_A22B", "QWEN3_30B_A3B",
           "TABLE_2", "Deployment", "ModelConfig", "checkpoint", "megatron_maps", "sglang_maps",
           "workers"]
