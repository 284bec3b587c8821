"""`StagingSlots`: the receivers' staging-slot ledger (receiver staging), pure.

Owned by the group's `GroupLeader` on every path (the controller and the adapters' trainer 0);
the receivers' slots themselves are host buffers (`weightbridge.coordination.staging`). The
tests drive it directly (`tests/test_coordination.py`).
"""

from __future__ import annotations


class StagingSlots:
    """Sender-side bookkeeping of the receivers' host staging slots, per engine (RS modes).

    A transfer lands version v in one slot of every receiver of an engine; the engine's rank 0
    later `claim`s it, which pins that slot until the engine's next claim (rank 0 claims again
    only when every rank has installed, `EngineCoordinator.idle`). A new transfer writes the
    slot that is not pinned, overwriting a version that landed there but was never claimed: the
    newer one supersedes it. With two slots one is always free, so a rollout that stops polling
    never blocks the trainer.
    """

    def __init__(self, num_engines: int, num_slots: int = 2, *, first_slot: int = 0):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: one slot is pinned by the installed "
                             f"version, so landing needs at least two")
        self.num_slots = num_slots
        self.slot_ids = range(first_slot, first_slot + num_slots)
        """Slot numbers: a re-plan after a lost engine starts a new set (`first_slot`), so a
        receiver can keep the slot it is installing from while the new ones fill."""
        self._pinned: list[int | None] = [None] * num_engines
        # (engine, slot) -> version fully landed there; absent while empty or being written.
        self._landed: dict[tuple[int, int], int] = {}
        self._writing: dict[int, int] = {}

    def grow(self, num_engines: int) -> None:
        """Engines joined: they have nothing landed and nothing pinned yet."""
        self._pinned.extend([None] * (num_engines - len(self._pinned)))

    def replanned(self, first_slot: int) -> None:
        """The group was planned again: new transfers land in a new set of slots numbered from
        ``first_slot`` (the receivers made them at set-up; a set's numbers are never reused).
        A version that landed whole stays claimable where it is (the receivers keep the older
        slots, laid out for their older plan, until they install from a newer one); a version
        landing now never completes."""
        if first_slot < self.slot_ids.stop:
            raise ValueError(f"slots from {first_slot} after a set ending at "
                             f"{self.slot_ids.stop - 1}: a re-plan's slots are new numbers "
                             f"(its generation increases)")
        self.slot_ids = range(first_slot, first_slot + self.num_slots)
        self._writing = {}

    def begin(self, version: int, engines=None) -> dict[int, int]:
        """Start landing ``version`` in ``engines`` (None: every engine): the slot per
        engine to write into. An engine left out (out of the group) is given no slot of
        this set: it never made them."""
        slots = {}
        for e, pinned in enumerate(self._pinned):
            if engines is not None and e not in engines:
                continue
            free = [s for s in self.slot_ids if s != pinned]
            # The free slot holding the oldest (or no) version: keep the newest unclaimed one
            # while there are spare slots.
            slot = min(free, key=lambda s: self._landed.get((e, s), -1))
            self._landed.pop((e, slot), None)  # overwritten from now on: superseded
            slots[e] = slot
        self._writing = slots
        return slots

    def complete(self, version: int) -> None:
        """Every byte of ``version`` landed in the slots `begin` returned."""
        for e, slot in self._writing.items():
            self._landed[(e, slot)] = version
        self._writing = {}

    def claim(self, engine: int) -> tuple[int, int] | None:
        """Pin the slot of the newest version landed for ``engine``: (version, slot), or None
        when nothing has landed (or it is being overwritten by a transfer under way)."""
        held = [(v, s) for (e, s), v in self._landed.items() if e == engine]
        if not held:
            return None
        version, slot = max(held)
        self._pinned[engine] = slot
        for v, s in held:  # superseded: the engine never installs them now
            if s not in self.slot_ids and v < version:
                del self._landed[(engine, s)]
        return version, slot

    def claimed(self, engine: int) -> int | None:
        """The version in the slot ``engine`` claimed last (None: none, since these slots were
        made): its parameters hold it, or will before they install anything newer."""
        pinned = self._pinned[engine]
        return None if pinned is None else self._landed.get((engine, pinned))

    def landed(self, engine: int, slot: int) -> int | None:
        return self._landed.get((engine, slot))
