"""GRPO on Monarch: FSDP2 trainers, a generating vLLM engine of TP 2, WeightBridge between."""
