"""`TransferGroup.close()` on real Monarch meshes: safe on any handle, any number of times, and
it releases rollouts waiting for a version.

A trainer and a TP1 engine (`meshes.adapter_actors`); the handle from before `add_engines` and
the grown one are closed in either order, twice; a rollout blocked in ``wait_for_version``
when the group closes returns with `TransferFailed` saying so (long before its own
3 x ``timeout_s``), and so do trainers waiting inside ``send_weights``. Everything spawned is
stopped, even on failure.
"""

import os
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from monarch.actor import endpoint, this_host

from meshes.adapter_actors import RLRollout, RLTrainer, checkpoint
from meshprocs import close_group, proc_pair
from weightbridge import GroupClosed, TransferConfig, TransferGroup

pytestmark = pytest.mark.mesh

WAIT_S = 60.0
"""The rollouts' own wait: 3 x timeout_s = 180 s, far beyond how long a close may take."""


def _stopped(agents) -> bool:
    try:
        agents.release.call("no-such-group").get(timeout=30)
    except Exception:  # noqa: BLE001  (a stopped actor mesh refuses every call)
        return True
    return False


def test_close_is_idempotent_on_every_handle():
    joining = this_host().spawn_procs(per_host={"worker": 1}, name="joining")
    try:
        with proc_pair(1, 1) as (tprocs, rprocs):
            group = TransferGroup.spawn(tprocs, rprocs, engine_size=1,
                                        config=TransferConfig(timeout_s=WAIT_S))
            grown = group.add_engines(joining)
            try:
                grown.close()
                group.close()  # the handle from before add_engines: nothing left to stop
                grown.close()
                group.close()
                assert all(_stopped(agents) for agents in grown.spawned)
                other = TransferGroup.spawn(tprocs, rprocs, engine_size=1)
                grown2 = other.add_engines(joining)
                other.close()  # the old handle first: it stops the engines added later too
                assert all(_stopped(agents) for agents in grown2.spawned)
                grown2.close()
            finally:
                group.close()
    finally:
        joining.stop().get(timeout=60)


class _Trainer(RLTrainer):
    """Writes ``<where>/<trainer index>`` once its send_weights waits inside (its adapter logged
    "ready"): the actor serves no call while its send blocks, so the test learns it from a
    file a thread of the actor's process writes."""

    @endpoint
    def train_and_send_telling(self, version: int, where: str) -> None:
        ready = os.path.join(where, str(self.adapter.worker.index))
        threading.Thread(target=self._tell_ready, args=(version, ready), daemon=True).start()
        with torch.no_grad():
            self.shard.load_weights(checkpoint(self.model, version).items())
        self.adapter.send_weights(version)

    def _tell_ready(self, version: int, ready: str) -> None:
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            if any(e[1:] == ("ready", version) for e in self.adapter.events):
                open(ready, "w").close()
                return
            time.sleep(0.005)


@contextmanager
def _connected(num_trainers: int, config: TransferConfig):
    """(group, trainers, rollouts): ``num_trainers`` TP trainers and one TP1 engine,
    connected; the group and the actors are closed on exit, also on failure."""
    with proc_pair(num_trainers, 1) as (tprocs, rprocs):
        group = TransferGroup.spawn(tprocs, rprocs, engine_size=1, config=config)
        actors = []
        try:
            trainers = tprocs.spawn("trainer", _Trainer, "tiny", num_trainers)
            actors.append(trainers)
            rollouts = rprocs.spawn("rollout", RLRollout, "tiny", 1)
            actors.append(rollouts)
            trainers.setup.call(group).get(timeout=120)
            rollouts.setup.call(group).get(timeout=120)
            trainers.connect.call().get(timeout=120)
            yield group, trainers, rollouts
        finally:
            close_group(group, *actors)


@pytest.mark.parametrize("rs", [False, True], ids=["sync", "rs"])
def test_close_releases_a_rollout_waiting_for_a_version(rs):
    config = TransferConfig(timeout_s=WAIT_S, receiver_staging=rs, round_bytes=64 << 10)
    with _connected(1, config) as (group, _, rollouts):
        waiting = rollouts.wait_version.call(1, {1: None})  # nothing will send version 1
        group.close()
        with pytest.raises(Exception, match=f"transfer group {group.name} was closed") as e:
            waiting.get(timeout=WAIT_S)
        assert "TransferFailed" in str(e.value), e.value
        # Issue 44, item 10: a closed group's handle built workers as if it were open.
        with pytest.raises(GroupClosed, match=f"transfer group {group.name} was closed"):
            group.sender({}, None, None)


def test_close_releases_trainers_waiting_in_send_weights(tmp_path):
    # Sync, and no rollout polls: trainer 0 waits in send_weights(1) for the rollouts, trainer 1
    # for trainer 0. Before, close() released rollouts only, and the trainers waited out
    # their own timeout_s (and then the wait for a lost trainer 0). close() lands as soon as
    # both said "ready": trainer 0 is then inside its first peer calls of the transfer (asking
    # T1 and R0 for their inboxes, the OFFER), which waited out the peer timeout (48 s) and
    # were reported as lost workers before the mailboxes failed them at close.
    with _connected(2, TransferConfig(timeout_s=WAIT_S, round_bytes=64 << 10)) as (
            group, trainers, _):
        sending = [trainers.slice(worker=t).train_and_send_telling.call_one(1, str(tmp_path))
                   for t in range(2)]
        end = time.monotonic() + WAIT_S
        while len(os.listdir(tmp_path)) < 2:
            assert time.monotonic() < end, "the trainers never waited inside send_weights(1)"
            time.sleep(0.005)
        started = time.monotonic()
        group.close()
        for call in sending:
            with pytest.raises(Exception, match=f"transfer group {group.name} was closed") as e:
                call.get(timeout=WAIT_S)
            assert "TransferFailed" in str(e.value), e.value
        assert time.monotonic() - started < WAIT_S / 2
