"""Errors a user can cause. Each message says what is wrong and how to fix it."""


class LayoutError(ValueError):
    """A worker's layout cannot be discovered, or trainer and rollout layouts do not fit.

    Raised before any weight byte moves: a loader that changes values, a dtype mismatch between
    a checkpoint tensor and the parameter it lands in, a rollout element no trainer holds.
    """
