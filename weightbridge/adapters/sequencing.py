"""`Sequencing`: what trainer 0's policy modules use of its sequencer.

`weightbridge.adapters.rank0.GroupSequencer` runs every transfer of an adapter group and calls
out to two policy modules, `recovery` (a loss) and `sender_delta` (delta updates). They take
the sequencer as this protocol, so they depend on what it offers and not on its module (which
imports them): the policies sit below the sequencer, with no circle.
"""

from __future__ import annotations

from typing import Callable, Protocol

from weightbridge.config import TransferConfig
from weightbridge.coordination.control import ControlPlane, WorkerId
from weightbridge.coordination.leader import GroupLeader


class Sequencing(Protocol):
    """Trainer 0's sequencer, as its policy modules see it."""

    worker: WorkerId
    control: ControlPlane
    config: TransferConfig
    leader: GroupLeader
    """The group's state (every change of it goes through the leader)."""
    broken: str | None
    """Why the group can send no more (None while it can)."""
    done: Callable[[], int]
    """The newest version whose transfer finished on trainer 0."""

    def live(self) -> list[WorkerId]:
        """Every rollout worker of a live engine."""

    def live_trainers(self) -> list[WorkerId]:
        """Every trainer not out (trainer 0 first)."""

    def session(self, version: int, moved: list, release: bool) -> None:
        """Run one transfer of ``version`` (``moved[0]`` set once bytes move)."""

    def rejoin(self, moved: bool) -> None:
        """After a loss: count the surviving rollouts that had joined in again."""

    def close(self, why: str) -> None:
        """The group can send no more: every rollout told ``why``."""

    def tell_trainers(self, version: int, message: str, kind: str = "transfer",
                      lost: tuple | None = None) -> None:
        """Every other live trainer's send_weights(version) raises what ``kind`` names."""
