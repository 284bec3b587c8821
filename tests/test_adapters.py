"""The adapters over the real planner, executor and copy kernels, in one process.

Trainer and rollout workers are threads; `LocalControl` stands in for actor endpoints and
`LocalTransport` for RDMA writes. Each rollout engine runs its ranks in lockstep (a barrier
after every inference step, as an engine's collectives would), polling before every step.
Checked in every mode: bit-exact weights at every install, one version per engine at every
step, versions in order, and who waits for whom (ordering of logged events, no wall-clock
thresholds).
"""

import threading

import pytest
import torch

from moegroup import (CHECKPOINTS, CONFIG, ENGINE_TP, ENGINES, MODES, NUM_VERSIONS, REFERENCE,
                      SPEC, events_by_version, first_event, generate, group, run_versions,
                      same_bits)
from tinygroup import connect

from meshes.qwen3_moe import RolloutShard
from weightbridge import ReceiverAdapter, TransferConfig
from weightbridge.coordination.local_control import LocalControl


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_installs_bit_exact_versions_in_order_one_version_per_engine_step(mode):
    ss, rs = MODES[mode]
    hooked, after = [], []
    control, trainers, rollouts, steps = run_versions(
        TransferConfig(sender_staging=ss, receiver_staging=rs, round_bytes=96 << 10,
                       timeout_s=30), hook=hooked.append,
        after=lambda shard, k, v: after.append((v, same_bits(shard.params, REFERENCE[k][v]))))
    for (engine, step), versions in steps.items():
        assert len(versions) == 1, f"engine {engine} ran step {step} with versions {versions}"
    for _, a in rollouts:
        got = [v for _, w, v in a.events if w == "installed"]
        assert got == sorted(set(got)) and got[-1] == NUM_VERSIONS, got
        assert a.version == NUM_VERSIONS
    # The hook ran once before every install, with the version announced for it (SS without
    # RS: the transfer may then carry a newer staged version, which poll_requests returns).
    installs = sorted(v for v, seqs in events_by_version(rollouts).items() for _ in seqs)
    assert len(hooked) == len(installs) and sorted(hooked) <= installs
    # The after-hook ran once per install with the version installed, and found it whole in
    # the parameters (where an engine rebuilds what it derives from its weights).
    assert sorted(v for v, _ in after) == installs and all(whole for _, whole in after), after
    assert control.transport.bytes_written > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_who_waits_for_whom_in_each_mode(mode):
    ss, rs = MODES[mode]
    _, trainers, rollouts, _ = run_versions(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                    round_bytes=96 << 10, timeout_s=30))
    in_params = events_by_version(rollouts, "in_params")
    joins = [e for _, a in rollouts for e in a.events if e[1] == "join"]
    assert bool(joins) is (not rs), "rollouts join the transfer exactly when RS is off"
    for v, seqs in in_params.items():
        if not any(w == "released" and vv == v for _, a in trainers for _, w, vv in a.events):
            continue  # superseded before it was sent
        # "released": the moment send_weights(v) stops waiting (logged by whoever releases it).
        resumed = max(first_event(a, "released", v) for _, a in trainers)
        if ss or rs:
            # The trainers go on before any rollout runs the new version.
            assert resumed < min(seqs), (v, resumed, seqs)
        else:
            # Sync: no trainer goes on before every rollout installed it.
            assert len(seqs) == ENGINES * ENGINE_TP and resumed > max(seqs), (v, resumed, seqs)
    if ss:
        for _, a in trainers:  # each release follows its own staging copy
            for _, w, v in a.events:
                if w == "released":
                    assert first_event(a, "staged", v) < first_event(a, "released", v)


def test_sync_mode_raises_a_clear_timeout_when_rollouts_never_poll():
    control, trainers, _ = group(TransferConfig(timeout_s=0.5, round_bytes=96 << 10))
    connect(trainers)
    errors = []

    def send(shard, adapter):
        try:
            with torch.no_grad():
                shard.load_weights(CHECKPOINTS[1].items())
            adapter.send_weights(1)
        except TimeoutError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=send, args=t) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors and any("did not poll_requests()" in e for e in errors), errors


@pytest.mark.parametrize("mode", ["ss", "rs", "async"])
def test_a_rollout_that_stops_polling_does_not_block_the_trainers_and_gets_the_newest(mode):
    ss, rs = MODES[mode]
    control, trainers, rollouts = group(TransferConfig(sender_staging=ss, receiver_staging=rs,
                                                        round_bytes=96 << 10, timeout_s=30))
    connect(trainers)
    last = NUM_VERSIONS + 2

    def trainer(shard, adapter):
        for v in range(1, last + 1):
            with torch.no_grad():
                shard.load_weights(CHECKPOINTS[v].items())
            adapter.send_weights(v)   # no rollout polls meanwhile: must not block

    threads = [threading.Thread(target=trainer, args=tr) for tr in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a trainer blocked on rollouts not polling"
    if rs:
        trainers[0][1].wait_idle()
    # Now the engines poll, each rank on its own thread, in lockstep, until they run the newest.
    generate(rollouts, lambda: all(a.version == last for _, a in rollouts))
    trainers[0][1].wait_idle()
    for shard, a in rollouts:
        assert a.version == last
        assert same_bits(shard.params, REFERENCE[a.engine_rank][last])
        got = [v for _, w, v in a.events if w == "installed"]
        assert len(got) < last, f"older versions were superseded, not all installed: {got}"


@pytest.mark.parametrize("hook", ["before_update_hook", "after_update_hook"])
def test_a_hook_that_is_not_callable_is_refused_at_construction(hook):
    control, shard = LocalControl(), RolloutShard(CONFIG, ENGINE_TP, 0, 1, 0)
    with pytest.raises(ValueError, match=f"{hook} must be a callable taking the version"):
        ReceiverAdapter(shard.params, shard.load_weights, SPEC, rank=0, engine=0, engine_rank=0,
                        engine_size=ENGINE_TP, control=control, transport=control.transport,
                        **{hook: "engine.refresh"})
