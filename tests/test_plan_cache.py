"""The plan kept across restarts (`weightbridge.coordination.plan_cache`): read back only for
the same maps, sizes and planner code, only from this user's files, only as plan types; and a
restarted group connects on it without planning and moves bit-exact weights."""

import dataclasses
import json
import os
import pickle
import warnings

import pytest
from tinygroup import build, connect, in_threads, send

from weightbridge import TransferConfig, errors
from weightbridge.coordination import plan_cache
from weightbridge.coordination.plan_cache import (KEEP, PlanCache, PlanCacheWarning,
                                                   kept_or_planned, plan_key, plan_of)
from weightbridge.discovery.cache import _decode, _encode
from weightbridge.discovery.probe import Probed
from weightbridge.shapes import TABLE_2, workers

SIZES = {"round_bytes": TABLE_2[0].round_bytes, "depth": 2}


@pytest.fixture(scope="module")
def maps():
    """Moonlight's 16 workers (deployment (a)), shape-only maps."""
    return workers(TABLE_2[0])


def _spy(monkeypatch) -> list:
    """Count the plans made (a hit makes none)."""
    made: list = []
    real = plan_cache.plan_transfer
    monkeypatch.setattr(plan_cache, "plan_transfer",
                        lambda *a, **k: made.append(1) or real(*a, **k))
    return made


def test_a_second_connect_reads_the_plan_and_every_worker_plan_back(tmp_path, maps,
                                                                    monkeypatch):
    made = _spy(monkeypatch)
    cache = PlanCache(str(tmp_path))
    first, kept_first = kept_or_planned(cache, *maps, **SIZES)
    again, kept_again = kept_or_planned(cache, *maps, **SIZES)
    assert made == [1] and (kept_first, kept_again) == (False, True)
    # (A plan's route tables are numpy arrays, which == compares element by element.)
    assert pickle.dumps(again.plan) == pickle.dumps(first.plan)
    assert again.active == first.active and again.ranges == first.ranges
    assert again.outgoing == first.outgoing and again.handed == first.handed
    plans = first.plan.worker_plans()
    assert {w: pickle.loads(b) for w, b in again.handed.items()} == plans
    assert again.plan.worker_plans() == plans


def test_maps_read_back_from_the_source_map_cache_find_the_entry(maps):
    """A restart's maps come from the source map cache's JSON, their strings shared
    differently than a probe's: the key digests values, not object identity."""
    def restarted(side):
        return [(_decode(json.loads(json.dumps(_encode(Probed(m, ()))))).source_map, p)
                for m, p in side]
    trainers, rollouts = maps
    assert plan_key(restarted(trainers), restarted(rollouts), **SIZES) == plan_key(
        trainers, rollouts, **SIZES)


def test_whatever_decides_the_plan_changes_the_key(maps, monkeypatch):
    trainers, rollouts = maps
    key = plan_key(trainers, rollouts, **SIZES)
    smap, placement = rollouts[0]
    moved = dataclasses.replace(smap, pieces=smap.pieces[1:])
    assert plan_key(trainers, [(moved, placement), *rollouts[1:]], **SIZES) != key
    elsewhere = dataclasses.replace(placement, node=placement.node + "x")
    assert plan_key(trainers, [(smap, elsewhere), *rollouts[1:]], **SIZES) != key
    assert plan_key(trainers, rollouts, **{**SIZES, "round_bytes": 1 << 20}) != key
    assert plan_key(trainers, rollouts, **{**SIZES, "depth": 3}) != key
    monkeypatch.setattr(plan_cache, "planner_code", lambda: "another planner")
    assert plan_key(trainers, rollouts, **SIZES) != key


def test_an_entry_other_users_could_write_is_not_read(tmp_path, maps, monkeypatch):
    cache = PlanCache(str(tmp_path))
    kept_or_planned(cache, *maps, **SIZES)
    entry = cache.path(plan_key(*maps, **SIZES))
    os.chmod(entry, 0o664)
    made = _spy(monkeypatch)
    monkeypatch.setattr(errors, "_warned", set())
    with pytest.warns(PlanCacheWarning, match="writable by other users"):
        kept_or_planned(cache, *maps, **SIZES)
    assert made == [1]
    os.chmod(entry, 0o600)
    os.chmod(tmp_path, 0o777)
    try:
        monkeypatch.setattr(errors, "_warned", set())
        with pytest.warns(PlanCacheWarning, match="its directory is writable by other users"):
            assert cache.load(plan_key(*maps, **SIZES)) is None
    finally:
        os.chmod(tmp_path, 0o700)
    assert cache.load(plan_key(*maps, **SIZES)) is not None


class _Runs:
    """Pickles to a call of ``os.system``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_an_entry_that_would_run_code_is_refused_unrun(tmp_path, maps):
    cache = PlanCache(str(tmp_path))
    key = plan_key(*maps, **SIZES)
    tmp_path.chmod(0o700)
    marker = tmp_path / "ran"
    cache.path(key).write_bytes(pickle.dumps((plan_cache.FORMAT, key,
                                              _Runs(f"touch {marker}"))))
    cache.path(key).chmod(0o600)
    assert cache.load(key) is None
    assert not marker.exists()


def test_a_torn_entry_is_planned_afresh_and_replaced(tmp_path, maps, monkeypatch):
    cache = PlanCache(str(tmp_path))
    first, _ = kept_or_planned(cache, *maps, **SIZES)
    path = cache.path(plan_key(*maps, **SIZES))
    path.write_bytes(path.read_bytes()[:1000])
    made = _spy(monkeypatch)
    again, kept = kept_or_planned(cache, *maps, **SIZES)
    assert again.handed == first.handed and not kept
    assert made == [1] and cache.load(plan_key(*maps, **SIZES)) is not None


def test_only_the_most_recently_used_entries_stay(tmp_path, maps):
    cache = PlanCache(str(tmp_path))
    planned = plan_of(*maps, **SIZES)
    key = plan_key(*maps, **SIZES)
    cache.save(key, planned)
    for i in range(KEEP + 1):
        cache.save(f"other{i}", planned)
        os.utime(cache.path(f"other{i}"), ns=((i + 1) * 10**9,) * 2)
        os.utime(cache.path(key), ns=(0, 0))  # the oldest of all, but ...
        assert cache.load(key) is not None  # ... read by every connect: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{key}.plan"] + [f"other{i}.plan" for i in range(KEEP + 1)][-(KEEP - 1):])


def test_a_directory_that_cannot_be_written_is_warned_about_and_connect_plans(tmp_path, maps,
                                                                             monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(errors, "_warned", set())
    with pytest.warns(PlanCacheWarning, match="cannot write it"):
        planned, kept = kept_or_planned(PlanCache(str(blocked / "plans")), *maps, **SIZES)
    assert planned.plan.num_rounds > 0 and not kept


@pytest.mark.parametrize("bad", ["", 3, b"dir"])
def test_a_plan_cache_that_is_not_a_directory_path_is_refused(bad):
    with pytest.raises(ValueError, match="plan_cache must be a directory path"):
        TransferConfig(plan_cache=bad)


def test_a_restarted_group_connects_on_the_kept_plan_and_moves_bit_exact_weights(
        tmp_path, monkeypatch):
    made = _spy(monkeypatch)
    config = TransferConfig(timeout_s=10, plan_cache=str(tmp_path), source_map_cache=None)
    for restart in range(2):  # the same group built afresh: a restart
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the probe's: unsourced padding)
            _, trainers, rollouts = build(config)
            connect(trainers)
        assert made == [1]  # planned at the first connect only
        steps = trainers[0][1].group.steps  # (trainer 0 leads the group)
        assert (steps.maps, steps.plan) == ("probed", "kept" if restart else "planned")
        version = 1 + restart
        assert in_threads(*send(trainers, version, ss=False),
                          *[lambda a=a: a.wait_for_version(version) for _, a in rollouts]
                          ) == [None] * len(trainers) + [version] * len(rollouts)
        assert all(m.holds(version) for m, _ in rollouts)
