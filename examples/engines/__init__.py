"""Real engines as WeightBridge workers: vLLM rollouts (`vllm_rollout`), torchtitan trainers, and
the tiny models both build (`models`). Needs the ``engines`` extra (docs/engines.md)."""
