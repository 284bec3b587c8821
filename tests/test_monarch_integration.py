"""`weightbridge.TransferGroup` with a user's own actors, as docs/integration.md describes them.

The actors here are what a user writes, and nothing more: SYNC Monarch actors (plain ``def``
endpoints, no endpoint of the library's) on proc meshes whose axes are not called ``worker``
(trainers ``{"gpus": 2}``, rollouts ``{"replica": 2, "tp": 2}``: two engines of TP2, an engine
per replica). Each builds its shard of the tiny Qwen3-MoE (`meshes.qwen3_moe`), then its
adapter with ``group.sender`` / ``group.receiver``; the trainers ``connect`` and
``send_weights(v)``, the rollouts ``wait_for_version(v)``, all while blocked in those calls
(the group's agents serve the peer calls). Checked in each mode (sender staging x receiver
staging), for two versions: every rollout parameter is bit-identical to what the rank's own
``load_weights`` makes of that version's checkpoint, and the group's engines and engine ranks
match the rollout mesh's ``replica`` and ``tp`` coordinates.

One pair of proc meshes serves the module (spawning and importing torch dominate here); each
case spawns a fresh group and fresh actors on it, and releases them even when it fails.
"""

import pytest
import torch
from monarch.actor import Actor, current_rank, endpoint

from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from meshprocs import close_group, proc_meshes
from weightbridge import TransferConfig, TransferGroup

pytestmark = pytest.mark.mesh

MODEL = SIZES["tiny"]
SPEC = checkpoint_spec(MODEL)
TRAINERS, ENGINES, ENGINE_TP = 2, 2, 2
VERSIONS = 2
TIMEOUT_S = 30.0
MODES = {"sync": (False, False), "ss": (True, False), "rs": (False, True), "async": (True, True)}


def checkpoint(version: int) -> dict[str, torch.Tensor]:
    """Checkpoint ``version``: the same in every process (seeded), different per version."""
    gen = torch.Generator().manual_seed(4099 * version + 11)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in SPEC.tensors}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


class Trainer(Actor):
    """A user's trainer rank: a TP shard, its sender; sync endpoints only."""

    def __init__(self):
        torch.set_num_threads(1)

    @endpoint
    def setup(self, group) -> dict:
        rank = current_rank().rank
        self.shard = TrainerShard(MODEL, TRAINERS, rank, 1, 0)
        self.shard.load_weights(checkpoint(0).items())
        self.sender = group.sender(self.shard.params, self.shard.load_weights, SPEC)
        return {"rank": rank, "worker": self.sender.worker.index}

    @endpoint
    def connect(self) -> None:
        self.sender.connect()

    @endpoint
    def train_and_send(self, version: int) -> None:
        with torch.no_grad():  # the stand-in optimizer step
            self.shard.load_weights(checkpoint(version).items())
        self.sender.send_weights(version)

    @endpoint
    def finish(self) -> None:
        """Rank 0 in SS modes: every staged version was transferred."""
        if self.sender.worker.index == 0 and self.sender.config.sender_staging:
            self.sender.wait_idle()


class Rollout(Actor):
    """A user's rollout rank: a TP shard of the engine on its replica, its receiver."""

    def __init__(self):
        torch.set_num_threads(1)

    @endpoint
    def setup(self, group) -> dict:
        point = current_rank()
        self.tp_rank = point["tp"]
        self.shard = RolloutShard(MODEL, ENGINE_TP, self.tp_rank, 1, 0)
        self.shard.load_weights(checkpoint(0).items())
        self.receiver = group.receiver(self.shard.params, self.shard.load_weights, SPEC)
        return {"coords": dict(point), "worker": self.receiver.worker.index,
                "engine": self.receiver.engine, "engine_rank": self.receiver.engine_rank}

    @endpoint
    def receive(self, version: int) -> dict:
        """Poll until ``version`` is installed; compare every parameter, bit for bit, with this
        rank's own load_weights of the installed version."""
        installed = self.receiver.wait_for_version(version, timeout_s=3 * TIMEOUT_S)
        ref = RolloutShard(MODEL, ENGINE_TP, self.tp_rank, 1, 0)
        ref.load_weights(checkpoint(installed).items())
        differ = sorted(n for n, p in ref.params.items()
                        if not torch.equal(_bits(self.shard.params[n]), _bits(p)))
        return {"installed": installed, "compared": len(ref.params), "differ": differ}


@pytest.fixture(scope="module")
def procs():
    with proc_meshes(("trainer", {"gpus": TRAINERS}),
                     ("rollout", {"replica": ENGINES, "tp": ENGINE_TP})) as meshes:
        yield meshes


@pytest.mark.parametrize("mode", list(MODES))
def test_sync_actors_on_any_axes_install_bit_identical_versions(mode, procs):
    tp, rp = procs
    ss, rs = MODES[mode]
    config = TransferConfig(sender_staging=ss, receiver_staging=rs, timeout_s=TIMEOUT_S,
                            round_bytes=64 << 10)
    group = TransferGroup.spawn(tp, rp, engine_size=ENGINE_TP, config=config)
    actors = []
    try:
        trainers = tp.spawn(f"trainer_{mode}", Trainer)
        actors.append(trainers)
        rollouts = rp.spawn(f"rollout_{mode}", Rollout)
        actors.append(rollouts)
        setups = [trainers.setup.call(group), rollouts.setup.call(group)]
        trained, rolled = (f.get(timeout=120) for f in setups)
        assert sorted((r["rank"], r["worker"]) for r in trained.values()) == [(0, 0), (1, 1)]
        for r in rolled.values():  # worker j is engine j // TP, engine rank j % TP
            assert (r["engine"], r["engine_rank"]) == (r["coords"]["replica"], r["coords"]["tp"])
            assert r["worker"] == r["engine"] * ENGINE_TP + r["engine_rank"], r
        trainers.connect.call().get(timeout=120)
        for v in range(1, VERSIONS + 1):
            # Sent at once (calls are eager): the rollouts wait in wait_for_version while the
            # trainers send; in sync mode send_weights returns only once they installed v.
            received = rollouts.receive.call(v)
            trainers.train_and_send.call(v).get(timeout=3 * TIMEOUT_S)
            for point, r in received.get(timeout=3 * TIMEOUT_S).items():
                assert r["installed"] == v, (dict(point), r)
                assert r["compared"] > 0 and r["differ"] == [], (dict(point), r)
        trainers.finish.call().get(timeout=3 * TIMEOUT_S)
    finally:
        close_group(group, *actors)


def test_spawn_rejects_an_engine_size_that_does_not_divide_the_rollouts(procs):
    tp, rp = procs
    with pytest.raises(ValueError, match="engine_size=3 must divide the 4 rollout procs"):
        TransferGroup.spawn(tp, rp, engine_size=3)
    with pytest.raises(ValueError, match="TransferConfig"):
        TransferGroup.spawn(tp, rp, engine_size=2, config={"timeout_s": 5})
