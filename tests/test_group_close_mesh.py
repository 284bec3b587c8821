"""`TransferGroup.close()` on real Monarch meshes: safe on any handle, any number of times, and
it releases rollouts waiting for a version.

A trainer and a TP1 engine (`meshes.adapter_actors`); the handle from before `add_engines` and
the grown one are closed in either order, twice; a rollout blocked in ``wait_for_version``
when the group closes returns with `TransferFailed` saying so (long before its own
3 x ``timeout_s``), and so do trainers waiting inside ``send_weights``. Everything spawned is
stopped, even on failure.
"""

import time
from contextlib import contextmanager

import pytest
from monarch.actor import this_host

from meshes.adapter_actors import RLRollout, RLTrainer
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


@contextmanager
def _connected(num_trainers: int, config: TransferConfig):
    """(group, trainers, rollouts): ``num_trainers`` TP trainers and one TP1 engine,
    connected; the group and the actors are closed on exit, also on failure."""
    with proc_pair(num_trainers, 1) as (tprocs, rprocs):
        group = TransferGroup.spawn(tprocs, rprocs, engine_size=1, config=config)
        actors = []
        try:
            trainers = tprocs.spawn("trainer", RLTrainer, "tiny", num_trainers)
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


def test_close_releases_trainers_waiting_in_send_weights():
    # Sync, and no rollout polls: trainer 0 waits in send_weights(1) for the rollouts, trainer 1
    # for trainer 0. Before, close() released rollouts only, and the trainers waited out
    # their own timeout_s (and then the wait for a lost trainer 0).
    with _connected(2, TransferConfig(timeout_s=WAIT_S, round_bytes=64 << 10)) as (
            group, trainers, _):
        sending = [trainers.slice(worker=t).train_and_send.call_one(1) for t in range(2)]
        # An ordering sleep, kept on purpose: waiting instead for the trainers' "ready" (a file
        # a thread of their actors wrote) let close() land while trainer 0 was still inside a
        # peer call (its OFFER to R0, or its READY asks to T1), and that call waited out the
        # peer timeout (48 s) and was reported as a lost worker, not as the group closed
        # (.ci/run of 4f4a373, 6 Dec 2026): a known gap of close(), not fixed yet. 2 s puts
        # both trainers in their waits for the rollouts, which close() does end at once.
        time.sleep(2.0)
        started = time.monotonic()
        group.close()
        for call in sending:
            with pytest.raises(Exception, match=f"transfer group {group.name} was closed") as e:
                call.get(timeout=WAIT_S)
            assert "TransferFailed" in str(e.value), e.value
        assert time.monotonic() - started < WAIT_S / 2
