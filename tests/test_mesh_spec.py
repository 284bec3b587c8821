"""Mesh specs: parsing, derived degrees, and clear errors before anything spawns."""

import dataclasses

import pytest

from meshes.qwen3_moe import SIZES
from meshes.spec import trainer_shard
from weightbridge.specs import RolloutSpec, TrainerSpec

MODEL = SIZES["tiny"]


def test_trainer_spec_parses_and_lays_out_tp_fastest():
    spec = TrainerSpec.parse("nodes=2,gpus=2,tp=2,ep=2")
    spec.validate(MODEL)
    assert (spec.num_workers, spec.dp) == (4, 1)
    assert [spec.coords(w) for w in (0, 1, 2)] == [
        {"dp": 0, "pp": 0, "ep": 0, "tp": 0}, {"dp": 0, "pp": 0, "ep": 0, "tp": 1},
        {"dp": 0, "pp": 0, "ep": 1, "tp": 0}]


def test_rollout_spec_parses_engines():
    spec = RolloutSpec.parse("engines=2, nodes=1, gpus=2, tp=2")
    spec.validate(MODEL)
    assert spec.num_workers == 4 and spec.coords(3) == {"engine": 1, "ep": 0, "tp": 1}


@pytest.mark.parametrize("cls,text,match", [
    (TrainerSpec, "nodes=1,gpus=3,tp=3", "tp=3 does not divide the model's heads"),
    (TrainerSpec, "nodes=1,gpus=4,tp=2,ep=4", "tp\\*pp\\*ep = 8 must divide the 4 workers"),
    (TrainerSpec, "gpus=3,pp=3", "pp=3 must divide the model's 2 layers"),
    (TrainerSpec, "gpus=2,fsdp=1,tp=2", "drop tp/pp/ep"),
    (RolloutSpec, "engines=2,gpus=2,tp=1", "tp\\*ep = 1 must equal the 2 workers"),
    (RolloutSpec, "gpus=2,ep=2,tp=1,engines=0", "engines must be >= 1"),
    (TrainerSpec, "gpus=4,fsdp=2", "fsdp is a switch, 0 or 1, got fsdp=2"),
    (TrainerSpec, "gpus=4,fsdp=-1", "fsdp is a switch, 0 or 1, got fsdp=-1"),
])
def test_bad_specs_say_what_is_wrong(cls, text, match):
    with pytest.raises(ValueError, match=match):
        cls.parse(text).validate(MODEL)


def test_trainer_tp_must_divide_the_unpadded_vocabulary():
    model = dataclasses.replace(MODEL, vocab=1001)
    with pytest.raises(ValueError, match="tp=2 must divide the model's vocabulary of 1001"):
        TrainerSpec.parse("gpus=2,tp=2").validate(model)


def test_trainer_spec_builds_pipeline_stage_and_fsdp_shards():
    stage = trainer_shard(TrainerSpec.parse("gpus=4,tp=2,pp=2"), MODEL, 3)  # tp 1 of stage 1
    assert (stage.tp_rank, stage.first_layer, stage.is_last_stage) == (1, 1, True)
    flat = trainer_shard(TrainerSpec.parse("gpus=4,fsdp=1"), MODEL, 2)
    assert list(flat.params) == ["flat_param"] and flat.shard_start == 2 * flat.shard_numel


def test_validate_without_a_model_checks_the_layout_alone():
    TrainerSpec.parse("gpus=3,tp=3").validate()  # fits 3 workers; the demo model's heads aside
    RolloutSpec.parse("engines=3,gpus=3,tp=3").validate()
    for spec, match in ((TrainerSpec.parse("gpus=0"), "gpus must be >= 1"),
                        (TrainerSpec.parse("gpus=4,tp=2,ep=4"), "must divide the 4 workers"),
                        (TrainerSpec.parse("gpus=2,fsdp=2"), "fsdp is a switch"),
                        (RolloutSpec.parse("gpus=2"), "must equal the 2 workers")):
        with pytest.raises(ValueError, match=match):
            spec.validate()


@pytest.mark.parametrize("text,match", [("gpus", "expected key=value"),
                                        ("nodes=two", "not an integer"),
                                        ("replicas=2", "expected key=value"),
                                        ("tp=2,gpus=2,tp=1", "sets tp twice")])
def test_unparseable_specs_say_what_is_expected(text, match):
    with pytest.raises(ValueError, match=match):
        TrainerSpec.parse(text)
