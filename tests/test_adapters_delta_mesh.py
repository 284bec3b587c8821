"""Delta updates through the adapters on real Monarch meshes (CPU tensors, TCP RDMA fallback).

The user's own actors (`meshes.adapter_actors`: trainer TP2 -> two TP2 engines) send a full
version, then deltas of a tenth of the tensors (``send_weights(v, changed=...)``), then an
empty delta, in sync and RS modes. Checked: every rank installs each version bit-exact against
its own load_weights of what the trainers held (`held_checkpoint`), the delta plans move fewer
bytes than the full one, the empty one none. Meshes and agents stop even when a check fails.
"""

import pytest

from meshes.adapter_actors import RLRollout, RLTrainer
from meshes.qwen3_moe import SIZES, checkpoint_spec
from meshprocs import close_group, proc_pair
from weightbridge import TransferConfig, TransferGroup

pytestmark = pytest.mark.mesh

TP, ENGINES = 2, 2
NAMES = [t.name for t in checkpoint_spec(SIZES["tiny"]).tensors]
SHARE = NAMES[1::10]


@pytest.fixture(scope="module")
def procs():
    with proc_pair(TP, ENGINES * TP) as meshes:
        yield meshes


@pytest.mark.parametrize("mode", ["sync", "rs"])
def test_a_delta_through_the_adapters_on_meshes_moves_less_and_installs_bit_exact(mode, procs):
    tp, rp = procs
    config = TransferConfig(receiver_staging=mode == "rs", timeout_s=30, round_bytes=256 << 10)
    group = TransferGroup.spawn(tp, rp, engine_size=TP, config=config)
    trainers = rollouts = None
    try:
        trainers = tp.spawn(f"delta_trainer_{mode}", RLTrainer, "tiny", TP)
        rollouts = rp.spawn(f"delta_rollout_{mode}", RLRollout, "tiny", TP)
        for f in [trainers.setup.call(group), rollouts.setup.call(group)]:
            f.get()
        trainers.connect.call().get()
        history: dict = {}
        moved = {}
        for v, changed in ((1, None), (2, SHARE), (3, SHARE), (4, [])):
            history[v] = changed
            sent = (trainers.train_and_send.call(v) if changed is None else
                    trainers.train_and_send_delta.call(v, changed))
            installed = rollouts.wait_version.call(v, dict(history))
            sent.get()
            got = [held for _, held in installed.get().items()]
            assert got == [(v, True)] * (ENGINES * TP), (v, got)
            moved[v] = [b for _, b in trainers.plan_bytes.call().get().items() if b is not None]
        # The bar: a tenth of the tensors changed moves at most 15% of a full update.
        assert 0 < moved[2][0] == moved[3][0] <= 0.15 * moved[1][0], moved
        assert moved[4] == [0], moved
    finally:
        close_group(group, trainers, rollouts)
