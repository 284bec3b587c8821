"""What an update of the controller reports, and how it fails.

`UpdateReport` is what `MeshTransfer.update` returns (times, bytes, the verification, the
timing of every worker), `InstallReport` what `MeshTransfer.poll_requests` does (receiver
staging), `JoinReport` what `MeshTransfer.add_engine` does. An update that fails raises
`weightbridge.TransferFailed`, and `weightbridge.WorkersLost` when workers were lost and left
out while the surviving engines hold the version (both defined in `weightbridge.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.timing import UpdateTiming
from weightbridge import TransferFailed, WorkersLost  # noqa: F401 (importable here as before)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """What one update did and how long it took (seconds, wall clock on the controller)."""

    version: int
    train_step_s: float
    """Trainers loading the new version (the stand-in optimizer step)."""
    transfer_s: float
    """First send to last assemble: the end-to-end weight transfer time."""
    verify_s: float
    rdma_bytes: int
    """Bytes written over RDMA in all stages."""
    num_params: int
    """Rollout parameters compared (over all rollout workers)."""
    mismatched: tuple[str, ...]
    """``rollout<i>:<param>`` of every parameter whose checksum differs from its loader's."""
    timing: UpdateTiming | None = None
    """Every worker's spans and stall windows (actor clocks; see controller/timing.py)."""
    ideal_s: float = 0.0
    """Eq. (1) from the link probe at connect."""
    stall_s: float = 0.0
    """How long the trainers waited after their train step before `update` returned (their
    GPU stall for this transfer): the rounds (sync, RS), or taking the staged copy (SS,
    async)."""
    state: str = "installed"
    """Where the version is when the report is made: "installed" (the rollouts' parameters,
    verified), "landed" (their staging slots: `poll_requests` installs and verifies it) or
    "staged" (the trainers' staged copy: the rounds stream; `wait` returns their report)."""

    def line(self) -> str:
        if self.state == "staged":
            return (f"update {self.version}: train_step {self.train_step_s:.3f}s  staged in "
                    f"{self.stall_s:.3f}s (the trainers go on; the rounds stream)")
        verdict = ("landed in every live engine's staging slots (installed and verified at "
                   "poll_requests)" if self.state == "landed" else
                   f"all {self.num_params} rollout parameters bit-identical to their own "
                   f"load_weights(v{self.version})" if not self.mismatched else
                   f"MISMATCH in {len(self.mismatched)} of {self.num_params} parameters: "
                   f"{list(self.mismatched[:4])}")
        rate = self.rdma_bytes / self.transfer_s / 1e6 if self.transfer_s else 0.0
        return (f"update {self.version}: train_step {self.train_step_s:.3f}s  transfer "
                f"{self.transfer_s:.3f}s ({self.rdma_bytes / 1e6:.2f} MB over RDMA, "
                f"{rate:.0f} MB/s)  verify {self.verify_s:.3f}s  | {verdict}"
                + (f"\n  {self.timing_line()}" if self.timing is not None else ""))

    def timing_line(self) -> str:
        t = self.timing
        mean, peak = t.kernel_share()
        ratio = f"{t.ewtt_s / self.ideal_s:.2f}" if self.ideal_s > 0 else "n/a"
        return (f"EWTT {t.ewtt_s:.3f}s  AGST {t.agst_s:.3f}s  ideal {self.ideal_s:.4f}s  "
                f"EWTT/ideal {ratio}  pack+assemble {100 * mean:.1f}% of EWTT per worker "
                f"(busiest {100 * peak:.1f}%)")


@dataclass(frozen=True, slots=True, kw_only=True)
class InstallReport:
    """What `MeshTransfer.poll_requests` installed (seconds, wall clock on the controller)."""

    version: int
    install_s: float
    """Every live engine copying the version from its staging slot into its parameters (the
    rollouts' stall; 0 without receiver staging: the rounds wrote the parameters)."""
    verify_s: float
    num_params: int
    """Rollout parameters compared (over all live rollout workers)."""
    mismatched: tuple[str, ...]

    def line(self) -> str:
        verdict = (f"all {self.num_params} rollout parameters bit-identical to their own "
                   f"load_weights(v{self.version})" if not self.mismatched else
                   f"MISMATCH in {len(self.mismatched)} of {self.num_params} parameters")
        return (f"installed {self.version}: install {self.install_s:.3f}s  verify "
                f"{self.verify_s:.3f}s  | {verdict}")


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinReport:
    """What `MeshTransfer.add_engine` did (seconds, wall clock on the controller)."""

    engine: int
    """The joined engine's number."""
    spawn_s: float
    """Its procs (when spawned here), actors and transfer agents."""
    plan_s: float
    """Probing only its workers, extending the plan, setting up only it and the trainers."""
    catch_up_s: float
    """Moving the version the other engines hold into it (0: no update yet)."""
    rdma_bytes: int
    """Bytes the catch-up wrote: the joined engine's share of the model (appended rounds),
    or a whole update (mirrored: the other engines' forwards feed it)."""
    num_params: int
    """Its parameters compared after the catch-up."""
    mismatched: tuple[str, ...]
    num_rounds: tuple[int, int]
    """Rounds of the plan before and after the join (the appended ones carry only it)."""

    def line(self) -> str:
        verdict = (f"all {self.num_params} of its parameters bit-identical to their own "
                   f"load_weights" if not self.mismatched else
                   f"MISMATCH in {len(self.mismatched)} of {self.num_params} parameters")
        return (f"engine {self.engine} joined: spawn {self.spawn_s:.2f}s  probe+plan+setup "
                f"{self.plan_s:.3f}s  catch-up {self.catch_up_s:.3f}s "
                f"({self.rdma_bytes / 1e6:.2f} MB, rounds {self.num_rounds[0]} -> "
                f"{self.num_rounds[1]})  | {verdict}")


def mismatches(results: list, ranks: list[int] | None = None, side: str = "rollout"
               ) -> tuple[int, tuple[str, ...]]:
    """(parameters compared, ``<side><i>:<param>`` of each that differs) from every worker's
    (live checksums, own load_weights' checksums), in the order of ``ranks`` (default: all
    workers of ``side`` in rank order)."""
    bad, count = [], 0
    for i, (got, want) in zip(ranks if ranks is not None else range(len(results)), results):
        count += len(want)
        bad += [f"{side}{i}:{n}" for n in want if got.get(n) != want[n]]
    return count, tuple(bad)
