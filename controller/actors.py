"""`WorkerMeshes`: the trainer and rollout actor meshes of one `MeshTransfer`, and their lifetime.

Spawned on procs of this host (or placed on procs the caller gives: attached hosts, procs
reused across sessions), grown by one mesh per joining engine, addressed as runs of live ranks
(a lost trainer or engine is skipped), and stopped: procs spawned here are stopped, actors on
given procs are stopped one by one and the procs left to their owner.
"""

from __future__ import annotations

from monarch.actor import this_host

from controller.ranks import actor_at
from weightbridge import WeightBridgeError
from weightbridge.driver import (RolloutSpec, TrainerSpec, configure_transport,
                                 disown_faults, drop_all, own_faults)

PROBE_BYTES = 8 << 20
"""Link probe write size: one 8 MB RDMA chunk."""
PROBE_REPEATS = 3


class ClosingContext:
    """A context manager that runs ``self._start()`` on enter (and ``self.close()`` if that
    fails, so what had started stops) and ``self.close()`` on exit."""

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except WeightBridgeError as failed:  # a streamed version's failure close() found
            if exc is None:
                raise
            exc.add_note(f"(on leaving the block, close() also found: {failed!r})")


class WorkerMeshes:
    """Both sides' actor meshes (module doc). ``trainers`` and ``rollouts`` are the first
    meshes; ``rollout_meshes`` lists (first flat rank, mesh) of the rollouts, the first mesh
    and each joined engine's."""

    def __init__(self, trainer: TrainerSpec, rollout: RolloutSpec, workers: str, *, procs,
                 actor_classes: tuple[type, type]):
        self.trainer_spec, self.rollout_spec, self.workers = trainer, rollout, workers
        self.given_procs, self.actor_classes = procs, actor_classes
        self.owned: list = []
        """Procs spawned here (stopping them stops everything on them)."""
        self.actors: list = []
        self.foreign: list = []
        """Actor meshes on procs this object did not spawn (stopped one by one)."""
        self.rollout_meshes: list[tuple[int, object]] = []
        self.trainers = self.rollouts = None
        self.joined: dict[int, tuple[object, object]] = {}
        """First flat rank -> (actors, procs) of each engine `spawn_engine` added."""

    def spawn(self):
        """Procs (unless given) and both sides' actors; returns (trainer procs, rollout
        procs)."""
        if self.given_procs is None:
            configure_transport()  # before spawning: children read the config at start-up
            host = this_host()
            for side, spec in (("trainer", self.trainer_spec), ("rollout", self.rollout_spec)):
                self.owned.append(host.spawn_procs(per_host={"worker": spec.num_workers},
                                                   name=side))
            tp, rp = self.owned
        else:
            tp, rp = self.given_procs
        trainer_cls, rollout_cls = self.actor_classes
        self.trainers = tp.spawn("trainer", trainer_cls, self.workers, self.trainer_spec)
        self.actors.append(self.trainers)
        self.rollouts = rp.spawn("rollout", rollout_cls, self.workers, self.rollout_spec)
        self.actors.append(self.rollouts)
        own_faults(self.trainers, self.rollouts)  # (losses are found and raised by the driver)
        self.rollout_meshes = [(0, self.rollouts)]
        if self.given_procs is not None:
            self.foreign += self.actors
        return tp, rp

    def attach(self, group) -> None:
        """Every actor builds its rank's worker in ``group``."""
        for f in [m.attach.call(group) for m in self.actors]:
            f.get()

    def spawn_engine(self, procs, spec: RolloutSpec, first: int):
        """(procs, actors) of one joining engine (flat ranks from ``first``): on ``procs``, or
        on procs spawned on this host."""
        owned = procs is None
        if owned:
            procs = this_host().spawn_procs(per_host={"worker": spec.workers_per_engine},
                                            name=f"rollout-e{spec.engines - 1}")
            self.owned.append(procs)
        actors = procs.spawn("rollout", self.actor_classes[1], self.workers, spec, first)
        own_faults(actors)
        if not owned:
            self.foreign.append(actors)
        self.actors.append(actors)
        self.rollout_meshes.append((first, actors))
        self.joined[first] = (actors, procs)
        return procs, actors

    def retire_engine(self, first: int) -> list[Exception]:
        """A joined engine (flat ranks from ``first``) out of the group for good: forget it
        and stop its actors, or its procs if they were spawned here (their memory freed now,
        not at `stop`); returns what failed to stop."""
        actors, procs = self.joined.pop(first)
        return self.drop_engine(actors, procs)

    def owns(self, procs) -> bool:
        """Whether ``procs`` were spawned here (and are stopped here)."""
        return any(p is procs for p in self.owned)

    def drop_engine(self, actors, procs) -> list[Exception]:
        """Undo `spawn_engine` (a join whose set-up failed): forget the engine's ``actors``
        and stop them, or its ``procs`` if they were spawned here; returns what failed to
        stop (a proc that died)."""
        self.rollout_meshes = [(f, m) for f, m in self.rollout_meshes if m is not actors]
        self.joined = {f: (a, p) for f, (a, p) in self.joined.items() if a is not actors}
        self.actors = [m for m in self.actors if m is not actors]
        owned = self.owns(procs)
        self.owned = [p for p in self.owned if p is not procs]
        self.foreign = [m for m in self.foreign if m is not actors]
        try:
            (procs if owned else actors).stop().get(timeout=60)
        except Exception as e:  # noqa: BLE001  (a dead proc's; the caller says so)
            return [e]
        finally:
            disown_faults(actors)
        return []

    def stop(self) -> list[Exception]:
        """Stop every actor mesh on given procs and every proc spawned here; returns what
        failed (each one tried)."""
        errors = []
        for mesh in self.foreign + self.owned:
            try:
                mesh.stop().get(timeout=60)
            except Exception as e:  # keep stopping the others; the caller raises
                errors.append(e)
        disown_faults(*self.actors)
        self.owned, self.actors, self.foreign, self.joined = [], [], [], {}
        return errors

    def live(self, side: str, lost: set[int], engine_size: int) -> list[tuple[int, object]]:
        """(first flat rank, actor mesh) of each run of consecutive live ranks of one side,
        within each actor mesh, skipping the trainers or engines in ``lost``."""
        if side == "trainer":
            meshes, size = [(0, self.trainers)], 1
        else:
            meshes, size = self.rollout_meshes, engine_size
        out = []
        for first, mesh in meshes:
            num = int(mesh.size())
            runs: list[list[int]] = []
            for unit in range(first // size, (first + num) // size):  # an engine, a trainer
                if unit in lost:
                    continue
                if runs and runs[-1][1] == unit * size:
                    runs[-1][1] += size
                else:
                    runs.append([unit * size, (unit + 1) * size])
            if runs == [[first, first + num]]:
                out.append((first, mesh))
                continue
            flat = mesh.flatten("rank")
            out += [(a, flat.slice(rank=slice(a - first, b - first))) for a, b in runs]
        return out

    def probe_links(self) -> dict[str, float]:
        """Write PROBE_BYTES into rollout 0 from trainer 0 and from a rollout of another engine
        (or the same engine if there is one), best of PROBE_REPEATS each: one stream per link;
        bytes/s per link."""
        handle = actor_at(self.rollouts, 0).probe_buffer.call_one(PROBE_BYTES).get()
        writers = {"trainer->rollout": actor_at(self.trainers, 0)}
        spec = self.rollout_spec
        peer = spec.workers_per_engine if spec.engines > 1 else 1
        if peer < spec.num_workers:
            writers["rollout->rollout"] = actor_at(self.rollouts, peer)
        try:
            return {link: PROBE_BYTES / mesh.probe_link.call_one(
                handle, PROBE_BYTES, PROBE_REPEATS).get() for link, mesh in writers.items()}
        finally:
            drop_all({0: handle})
