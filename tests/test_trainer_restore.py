"""How a trainer gets its weights back after connect's probe (`TransferConfig.trainer_restore`).

By default it keeps no copy: the probe leaves NaN in each parameter's first elements and the
trainer's first send refuses, before any byte moves, parameters that still hold it (weights
not loaded after connect, or a step trained on the probe's values). A host copy only when the
config asks. The in-process adapters (`moegroup`) and one `TransferWorker`; no Monarch (the
controller's path: test_controller_modes.py).
"""

import warnings

import pytest
import torch
from moegroup import CHECKPOINTS, CONFIG, SPEC, group
from tinygroup import connect, in_threads

from meshes.qwen3_moe import TrainerShard
from weightbridge import Placement, TransferConfig, UnsourcedParameter
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.params import POISONED, poison, poisoned
from weightbridge.coordination.worker import TransferWorker

NOT_LOADED = "were not loaded after connect"


def _rs() -> TransferConfig:
    """Receiver staging: a trainer's send returns once its bytes landed (no rollout polls)."""
    return TransferConfig(receiver_staging=True, round_bytes=96 << 10, timeout_s=30)


def test_by_default_a_send_of_weights_not_loaded_after_connect_is_refused_before_any_byte():
    control, trainers, _ = group(_rs())  # (each trainer loaded version 0 before connect)
    assert trainers[0][1].config.trainer_restore == "none"
    connect(trainers)
    out = in_threads(*[lambda a=a: a.send_weights(1) for _, a in trainers])
    assert all(isinstance(e, ValueError) and NOT_LOADED in str(e)
               and 'trainer_restore="host-copy"' in str(e) for e in out), out
    assert control.transport.bytes_written == 0
    # Loading the weights after connect is the fix: the same send then goes.
    for shard, _ in trainers:
        with torch.no_grad():
            shard.load_weights(CHECKPOINTS[1].items())
    assert in_threads(*[lambda a=a: a.send_weights(1) for _, a in trainers]) == [None, None]
    assert control.transport.bytes_written > 0


def _worker(restore: str | None = None, extra: dict | None = None
            ) -> tuple[TrainerShard, TransferWorker]:
    shard = TrainerShard(CONFIG, 2, 0, 2, 1)
    shard.load_weights(CHECKPOINTS[0].items())
    shard.params.update(extra or {})
    config = TransferConfig(source_map_cache=None) if restore is None else TransferConfig(
        source_map_cache=None, trainer_restore=restore)
    worker = TransferWorker("trainer", shard.params, shard.load_weights, SPEC, rank=0,
                            placement=Placement("t"), transport=LocalControl().transport,
                            config=config)
    worker.on_source_map()
    return shard, worker


def test_a_step_trained_on_the_probes_values_is_refused_too():
    """NaN survives an optimizer step (and a step an AMP scaler skips leaves it in place), so
    a trainer that forgot to load and trained first is still caught at its send."""
    shard, worker = _worker()
    with torch.no_grad():
        for p in shard.params.values():
            p.mul_(0.999).add_(1e-3)
    with pytest.raises(ValueError, match=NOT_LOADED) as e:
        worker.check_sendable()
    assert f"{len(shard.params)} of its {len(shard.params)} parameters" in str(e.value)


def test_one_parameter_left_unloaded_is_named():
    shard, worker = _worker()
    skipped = "model.layers.0.input_layernorm.weight"  # (one checkpoint tensor, one parameter)
    with torch.no_grad():
        shard.load_weights((n, t) for n, t in CHECKPOINTS[1].items() if n != skipped)
    stale = [n for n, p in shard.params.items() if p.isnan().any()]
    assert len(stale) == 1, stale
    with pytest.raises(ValueError, match=f"1 of its {len(shard.params)} parameters") as e:
        worker.check_sendable()
    assert repr(stale[0]) in str(e.value)
    with torch.no_grad():
        shard.load_weights(CHECKPOINTS[1].items())
    worker.check_sendable()  # loaded: goes, and later sends are not checked again
    assert not worker._poisoned


def test_a_host_copy_is_kept_only_when_asked_and_then_nothing_is_poisoned():
    before = TrainerShard(CONFIG, 2, 0, 2, 1)
    before.load_weights(CHECKPOINTS[0].items())
    shard, worker = _worker("host-copy")
    assert all(torch.equal(shard.params[n].view(torch.uint8), p.view(torch.uint8))
               for n, p in before.params.items())
    worker.check_sendable()
    _, default = _worker()
    assert default.config.trainer_restore == "none" and default._poisoned


def test_poison_sets_nan_where_the_probe_left_values_and_keeps_padding_zero():
    params = {"w": torch.full((3, 40), -2.0, dtype=torch.bfloat16),
              "pad": torch.zeros(2, 8),  # padding at the start of a parameter stays zero
              "mixed": torch.tensor([0.0, -1.5, 0.0, -3.0], dtype=torch.float16),
              "ints": torch.arange(5), "empty": torch.empty(0, 4)}
    params["pad"][1] = -1.0
    poison(params)
    assert params["w"][0, :POISONED].isnan().all() and not params["w"][0, POISONED:].isnan().any()
    assert not params["w"][1:].isnan().any()
    assert torch.equal(params["pad"][0], torch.zeros(8))
    assert torch.equal(params["mixed"].isnan(), torch.tensor([False, True, False, True]))
    assert torch.equal(params["ints"], torch.arange(5))
    assert sorted(poisoned(params)) == ["mixed", "w"]


@pytest.mark.parametrize("restore", ["none", "host-copy"])
def test_a_trainer_parameter_no_checkpoint_element_lands_in_is_named_when_no_copy_is_kept(
        restore):
    """A buffer the model computes (not in the checkpoint) is zeroed by the probe and not
    written by a load of the checkpoint either: said by name unless the host copy keeps it."""
    extra = {"rotary.inv_freq": torch.full((16,), 7.0)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shard, _ = _worker(restore, extra)
    named = [w for w in seen if issubclass(w.category, UnsourcedParameter)
             and "rotary.inv_freq" in str(w.message)]
    kept = torch.equal(shard.params["rotary.inv_freq"], torch.full((16,), 7.0))
    assert (bool(named), kept) == ((True, False) if restore == "none" else (False, True))
