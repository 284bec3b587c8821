"""Engines joining and leaving a running adapter group on real Monarch meshes, sync and async.

Trainer TP2 and two TP1 engines on this host (`meshes.adapter_actors`, the user's own actors
with the adapters inside). After version 1, a third engine is spawned on procs of its own,
joins (`TransferGroup.add_engines`, then `add_engines` on every trainer) and installs version 2
whole; then engine 0 is removed and versions 3 and 4 reach engines 1 and 2. Every install is
checked bit-exact on the rank against its own loader; engine 0's next poll raises. Everything
spawned is stopped, even on failure.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
from monarch.actor import this_host

from meshes.adapter_actors import RLRollout, RLTrainer
from meshprocs import proc_pair
from weightbridge import TransferConfig, TransferGroup

pytestmark = pytest.mark.mesh

MODES = {"sync": (False, False), "async": (True, True)}


def _update(trainers, engines, version: int, ss: bool) -> list[dict]:
    """send_weights(version) on the trainers while every engine steps on its own (as the
    engines of an RL loop do: a sync poll blocks until the transfer is done), until each
    engine runs ``version``; the steps' records."""
    sent = trainers.train_and_send.call(version)

    def steps(mesh) -> list[dict]:
        records = []
        for seed in range(400):
            records += mesh.step.call(seed).get(timeout=120).values()
            if records[-1]["version"] >= version:
                return records
        raise AssertionError(f"version {version} was not installed on {records[-1]['rank']}")

    with ThreadPoolExecutor(len(engines)) as pool:
        records = [r for rs in pool.map(steps, engines) for r in rs]
    sent.get(timeout=120)
    if ss:
        trainers.finish.call().get(timeout=120)
    return records


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_engine_joins_and_another_leaves_during_updates_bit_exact(mode):
    ss, rs = MODES[mode]
    config = TransferConfig(timeout_s=20, sender_staging=ss, receiver_staging=rs,
                            round_bytes=64 << 10)
    joining = this_host().spawn_procs(per_host={"worker": 1}, name="joining")
    group = None
    try:
        with proc_pair(2, 2) as (tprocs, rprocs):
            group = TransferGroup.spawn(tprocs, rprocs, engine_size=1, config=config)
            trainers = tprocs.spawn("trainer", RLTrainer, "tiny", 2)
            rollouts = rprocs.spawn("rollout", RLRollout, "tiny", 1)
            trainers.setup.call(group).get()
            rollouts.setup.call(group).get()
            trainers.connect.call().get()
            old = [rollouts.slice(worker=0), rollouts.slice(worker=1)]
            records = _update(trainers, old, 1, ss)
            grown = group.add_engines(joining)
            new = joining.spawn("rollout", RLRollout, "tiny", 1)
            new.setup.call(grown).get()
            trainers.add_engines.call(grown).get(timeout=120)
            group = grown
            records += _update(trainers, old + [new], 2, ss)
            first_new = [r for r in records if r["rank"] == 2 and r["installed"] is not None]
            assert first_new and first_new[0]["installed"] == 2  # a whole version, the next one
            trainers.remove_engine.call(0).get(timeout=120)
            with pytest.raises(Exception, match="engine 0 was removed"):
                old[0].step.call(0).get(timeout=60)
            for version in (3, 4):
                records += _update(trainers, [old[1], new], version, ss)
            installs = [r for r in records if r["installed"] is not None]
            assert installs and all(r["exact"] for r in installs), installs
            assert {r["rank"] for r in installs if r["installed"] == 4} == {1, 2}
            group.close()
            group = None
    finally:
        if group is not None:
            try:
                group.close()
            except Exception:  # noqa: BLE001  (the procs are stopped below either way)
                pass
        joining.stop().get(timeout=60)
