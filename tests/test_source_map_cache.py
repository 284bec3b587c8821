"""Source maps kept across restarts (`weightbridge.discovery.cache`), without Monarch.

A kept map is used only after the verification pass alone confirmed it on the live loader: a
loader that changed behind an unchanged key is caught and probed again, and whatever map is
used reproduces the loader bit for bit. Keys separate what decides a map (worker, checkpoint,
parameters, loader code and settings); entries are JSON, written atomically, and a bad entry or
directory costs a probe, never a connect.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from meshes.fp8_rollout import Fp8RolloutShard
from meshes.qwen3_moe import SIZES, RolloutShard, TrainerShard, checkpoint_spec
from weightbridge import CheckpointSpec, TensorSpec, TransferConfig, replay
from weightbridge.coordination.local_control import LocalControl
from weightbridge.coordination.session import source_maps
from weightbridge.coordination.worker import TransferWorker
from weightbridge.discovery.cache import (SourceMapCache, SourceMapCacheWarning, _decode,
                                          _encode, cache_key, loader_fingerprint, probe_cached)
from weightbridge.discovery.probe import probe, reverify
from weightbridge.types import Placement, WorkerId

CONFIG = SIZES["tiny"]
SPEC = CheckpointSpec(tuple(TensorSpec(f"w{i}", (8, 6), "bfloat16") for i in range(3)))


class Rank:
    """Rows ``perm`` of every tensor: the permutation is a tensor, so the cache key does not
    see it change (the case the verification pass is for). Loads are counted in a dict,
    which the key does not read either (an int attribute would be a setting to it)."""

    def __init__(self, rows=(0, 2, 4, 6)):
        self.perm = torch.tensor(rows)
        self.params = {t.name: torch.zeros(len(rows), 6, dtype=torch.bfloat16)
                       for t in SPEC.tensors}
        self.count = {"loads": 0}

    def load_weights(self, weights):
        self.count["loads"] += 1
        for name, t in weights:
            self.params[name].copy_(t[self.perm])


def _random_checkpoint(seed=5):
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=gen).bfloat16() for t in SPEC.tensors}


def _replays_bit_exactly(smap, rank):
    """The map filled from a random checkpoint equals what the loader itself loads."""
    checkpoint = _random_checkpoint()
    rank.load_weights(checkpoint.items())
    want = {n: p.clone() for n, p in rank.params.items()}
    for p in rank.params.values():
        p.zero_()
    replay(smap, rank.params, checkpoint)
    return all(torch.equal(rank.params[n].view(torch.uint8), want[n].view(torch.uint8))
               for n in want)


def test_a_second_probe_of_the_same_worker_loads_once_and_reuses_the_map(tmp_path):
    cache = SourceMapCache(str(tmp_path))
    first = Rank()
    smap, reused = probe_cached(first.params, first.load_weights, SPEC, cache=cache,
                                worker="rollout 0")
    assert not reused and first.count["loads"] >= 2  # index pass(es), then verification
    again = Rank()
    smap2, reused = probe_cached(again.params, again.load_weights, SPEC, cache=cache,
                                 worker="rollout 0")
    assert reused and again.count["loads"] == 1  # the verification pass alone
    assert smap2 == smap and _replays_bit_exactly(smap2, again)


def test_a_changed_loader_behind_the_same_key_is_caught_and_probed_again(tmp_path):
    cache = SourceMapCache(str(tmp_path))
    old = Rank((0, 2, 4, 6))
    changed = Rank((1, 3, 5, 7))  # another shard: same code, shapes and plain settings
    key = cache_key("r0", changed.params, changed.load_weights, SPEC)
    assert key == cache_key("r0", old.params, old.load_weights, SPEC)
    old_map, _ = probe_cached(old.params, old.load_weights, SPEC, cache=cache, worker="r0")
    assert not reverify(cache.load(key), changed.params, changed.load_weights, SPEC)
    smap, reused = probe_cached(changed.params, changed.load_weights, SPEC, cache=cache,
                                worker="r0")
    assert not reused and smap != old_map
    assert _replays_bit_exactly(smap, Rank((1, 3, 5, 7)))
    assert cache.load(key).source_map == smap  # the entry was replaced


def test_a_kept_map_for_other_shapes_is_not_verified_as_the_live_one(tmp_path):
    rank = Rank()
    probed = probe(rank.params, rank.load_weights, SPEC)
    wider = Rank((0, 1, 2, 3, 4, 5))
    assert not reverify(probed, wider.params, wider.load_weights, SPEC)


class PaddedRank(Rank):
    """`Rank` whose parameters have one more row, which the loader never writes (padding)."""

    def __init__(self, rows=(0, 2, 4, 6), skip_row=None):
        super().__init__(rows)
        self.params = {n: torch.zeros(len(rows) + 1, 6, dtype=torch.bfloat16)
                       for n in self.params}
        self.skip_row = skip_row
        """A row of ``w1`` this loader leaves alone (a changed loader), or None."""

    def load_weights(self, weights):
        self.count["loads"] += 1
        for name, t in weights:
            p = self.params[name]
            old = p[self.skip_row].clone() if name == "w1" and self.skip_row is not None else None
            p[:len(self.perm)].copy_(t[self.perm])
            if old is not None:
                p[self.skip_row] = old


def test_a_kept_maps_check_zeroes_only_the_padding_and_still_confirms_the_map():
    """The check of a kept map does not zero every parameter first, only the elements no
    checkpoint element lands in: padding that holds the caller's values (here 7.0) before it
    must not fail the check (the loader never writes it), and is zero after it."""
    rank = PaddedRank()
    probed = probe(rank.params, rank.load_weights, SPEC)
    assert probed.source_map.unsourced == tuple((n, 6) for n in rank.params)
    for p in rank.params.values():
        p.fill_(7.0)
    assert reverify(probed, rank.params, rank.load_weights, SPEC)
    assert all(torch.equal(p[-1], torch.zeros(6, dtype=torch.bfloat16))
               for p in rank.params.values())


@pytest.mark.parametrize("before", ["real values", "the probe's values"])
def test_a_kept_map_whose_loader_now_leaves_a_row_alone_is_refused(before):
    """Not zeroed first, an element the load leaves alone keeps its old value: the check's
    values are drawn afresh, so it differs from the new one even when the old value is the
    last probe's or check's in this process (with a fixed draw, it would be the same)."""
    rank = PaddedRank()
    probed = probe(rank.params, rank.load_weights, SPEC)
    changed = PaddedRank(skip_row=2)
    if before == "real values":
        changed.load_weights(_random_checkpoint().items())
    else:
        changed.params = rank.params  # as the probe left them
    assert not reverify(probed, changed.params, changed.load_weights, SPEC)
    assert reverify(probed, rank.params, rank.load_weights, SPEC)
    changed.params = rank.params  # as the last check left them
    assert not reverify(probed, changed.params, changed.load_weights, SPEC)


def test_keys_tell_workers_loaders_settings_and_checkpoints_apart():
    rank = Rank()
    base = cache_key("rollout 0", rank.params, rank.load_weights, SPEC)

    def other_loader(weights):
        for name, t in weights:
            rank.params[name].copy_(t[1::2])
    other_spec = CheckpointSpec(SPEC.tensors[:2])
    assert len({base, cache_key("rollout 1", rank.params, rank.load_weights, SPEC),
                cache_key("rollout 0", rank.params, other_loader, SPEC),
                cache_key("rollout 0", rank.params, rank.load_weights, other_spec)}) == 4
    shards = [RolloutShard(CONFIG, 2, r, 1, 0).load_weights for r in range(2)]
    assert loader_fingerprint(shards[0]) != loader_fingerprint(shards[1])  # tp_rank differs
    assert loader_fingerprint(shards[0]) == loader_fingerprint(
        RolloutShard(CONFIG, 2, 0, 1, 0).load_weights)  # a restart: same settings


def test_a_corrupt_entry_is_a_miss_and_is_replaced(tmp_path):
    cache = SourceMapCache(str(tmp_path))
    rank = Rank()
    key = cache_key("r0", rank.params, rank.load_weights, SPEC)
    cache.path(key).write_text("{not json")
    assert cache.load(key) is None
    smap, reused = probe_cached(rank.params, rank.load_weights, SPEC, cache=cache, worker="r0")
    assert not reused and cache.load(key).source_map == smap
    entry = json.loads(cache.path(key).read_text())
    entry["format"] += 1  # an entry of another format
    cache.path(key).write_text(json.dumps(entry))
    assert cache.load(key) is None


def test_an_unwritable_directory_warns_and_connect_goes_on(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    rank = Rank()
    with pytest.warns(SourceMapCacheWarning, match="TransferConfig"):
        smap, reused = probe_cached(rank.params, rank.load_weights, SPEC,
                                    cache=SourceMapCache(str(blocked / "maps")), worker="r0")
    assert not reused and _replays_bit_exactly(smap, Rank())


@pytest.mark.parametrize("make", [
    lambda: (RolloutShard(CONFIG, 2, 1, 1, 0), checkpoint_spec(CONFIG)),  # padded vocab: holes
    lambda: (RolloutShard(CONFIG, 1, 0, 1, 0), checkpoint_spec(CONFIG, "float32")),  # casts
    lambda: (TrainerShard(CONFIG, 2, 0, 2, 1), checkpoint_spec(CONFIG)),
    # block-quantizing to FP8, with scales
    lambda: (Fp8RolloutShard(CONFIG, 1, 0, 1, 0, block=(32, 32)), checkpoint_spec(CONFIG)),
])
@pytest.mark.slow
def test_entries_round_trip_and_reverify_on_a_fresh_build(make):
    shard, spec = make()
    probed = probe(shard.params, shard.load_weights, spec)
    kept = _decode(json.loads(json.dumps(_encode(probed))))
    assert kept == probed
    fresh, _ = make()
    assert reverify(kept, fresh.params, fresh.load_weights, spec)


def test_a_kept_map_checks_its_padding_stays_zero():
    """The unsourced ranges travel with the map: a loader that now writes into the padding
    fails the verification pass."""
    shard = RolloutShard(CONFIG, 2, 1, 1, 0)  # vocabulary padded: the last rows unsourced
    probed = probe(shard.params, shard.load_weights, checkpoint_spec(CONFIG))
    assert probed.holes

    def writes_padding(weights):
        shard.load_weights(weights)
        for name, ranges in probed.holes:
            flat = shard.params[name].view(-1)
            flat[ranges[0][0]] = 1.0
    assert not reverify(probed, shard.params, writes_padding, checkpoint_spec(CONFIG))
    assert reverify(probed, shard.params, shard.load_weights, checkpoint_spec(CONFIG))


def _worker(side, shard, config):
    return TransferWorker(side, shard.params, shard.load_weights, checkpoint_spec(CONFIG),
                          rank=0, placement=Placement(side), transport=LocalControl().transport,
                          config=config)


def test_a_trainer_reusing_its_map_gets_its_weights_back_bit_exactly(tmp_path):
    config = TransferConfig(source_map_cache=str(tmp_path), trainer_restore="host-copy")
    first = TrainerShard(CONFIG, 2, 0, 2, 1)
    _worker("trainer", first, config).on_source_map()
    shard = TrainerShard(CONFIG, 2, 0, 2, 1)
    gen = torch.Generator().manual_seed(3)
    shard.load_weights([(t.name, torch.randn(t.shape, generator=gen).bfloat16())
                        for t in checkpoint_spec(CONFIG).tensors])
    before = {n: p.clone() for n, p in shard.params.items()}
    worker = _worker("trainer", shard, config)
    assert worker.on_source_map("kept")
    smap, _, _ = worker.on_source_map("verify")
    assert worker.map_reused
    assert all(torch.equal(shard.params[n].view(torch.uint8), p.view(torch.uint8))
               for n, p in before.items())


def test_with_the_cache_off_nothing_is_kept(tmp_path):
    config = TransferConfig(source_map_cache=None)
    for _ in range(2):
        worker = _worker("rollout", RolloutShard(CONFIG, 1, 0, 1, 0), config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            worker.on_source_map("probe")
        assert not worker.on_source_map("kept") and worker.on_source_map("verify") is None


class _Calls:
    """A control plane in one thread: each call runs on every worker in turn (the protocol's
    logic, without threads or Monarch)."""

    def __init__(self, workers):
        self.workers = workers

    def call(self, peers, call, *args):
        return [call.serve(self.workers[w], *args) for w in peers]


class _Counted:
    """A rank's loader that counts its loads."""

    def __init__(self, rank):
        self.rank, self.loads = rank, [0]

    def __call__(self, weights):
        self.loads[0] += 1
        self.rank.load_weights(weights)


def _group(config, ranks=(0, 1)):
    out = {}
    for r in ranks:
        shard = RolloutShard(CONFIG, 2, r, 1, 0)
        load = _Counted(shard)
        out[WorkerId("rollout", r)] = (TransferWorker(
            "rollout", shard.params, load, checkpoint_spec(CONFIG), rank=r,
            placement=Placement("r", engine=0), transport=LocalControl().transport,
            config=config), load)
    return out


@pytest.mark.parametrize("kept", ["every", "one", "one-stale"])
@pytest.mark.slow
def test_every_worker_of_a_group_takes_the_same_way(tmp_path, kept):
    """Kept maps are verified only when every worker holds one and all hold; else every
    worker probes: a collective loader sees the same loads on every rank."""
    config = TransferConfig(source_map_cache=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (padding: UnsourcedParameter)
        first = _group(config)
        source_maps(_Calls({w: x for w, (x, _) in first.items()}), list(first))
        group = _group(config)  # a restart: the same workers built afresh
        if kept != "every":  # rank 1's entry gone, or one kept for another worker
            x, _ = group[WorkerId("rollout", 1)]
            entry = SourceMapCache(str(tmp_path)).path(
                cache_key(str(x.worker), x.params, x.load_weights, x.spec))
            if kept == "one":
                entry.unlink()
            else:
                other = json.loads(next(p for p in tmp_path.iterdir() if p != entry).read_text())
                entry.write_text(json.dumps({**other, "key": entry.stem}))
        found, how = source_maps(_Calls({w: x for w, (x, _) in group.items()}), list(group))
    loads = [load.loads[0] for _, load in group.values()]
    reused = [x.map_reused for x, _ in group.values()]
    assert len(set(loads)) == 1 and len(set(reused)) == 1
    assert reused[0] == (kept == "every") and (loads[0] == 1) == (kept == "every")
    assert how == ("kept" if kept == "every" else "probed")
    assert [m for m, _, _ in found] == [x.source_map for x, _ in first.values()]


@pytest.mark.parametrize("bad", ["", 3, b"dir"])
def test_a_cache_that_is_not_a_directory_path_is_refused(bad):
    with pytest.raises(ValueError, match="source_map_cache must be a directory path"):
        TransferConfig(source_map_cache=bad)
