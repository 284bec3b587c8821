"""The GRPO run's picture: reward per step, and the share of each step spent in the weight sync
(matplotlib, from the ``bench`` extra the default install has)."""

from __future__ import annotations

from pathlib import Path


def write_png(path: str | Path, rewards: list[float], sync_share: list[float],
              title: str) -> Path:
    """Two panels over the steps: mean reward, and send_weights time / step time. Returns the
    path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rewards or len(rewards) != len(sync_share):
        raise ValueError(f"need one sync share per reward, got {len(rewards)} rewards and "
                         f"{len(sync_share)} shares")
    steps = range(1, len(rewards) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), constrained_layout=True)
    left.plot(steps, rewards, marker=".", color="tab:blue")
    left.set(xlabel="step", ylabel="mean reward", ylim=(0, 1.02), title="reward")
    right.plot(steps, [100 * s for s in sync_share], marker=".", color="tab:orange")
    right.set(xlabel="step", ylabel="% of the step", ylim=(0, 100),
              title="weight sync (send_weights) share")
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
