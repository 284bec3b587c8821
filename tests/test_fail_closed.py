"""Fail closed, in one process: a rollout worker lost in the middle of a transfer, and probing
workers whose loaders are collective. Trainers TP2 -> two TP2 engines (`tests/moegroup.py`
helpers); `LocalControl.kill` stands in for a dead process (its calls and writes fail).

Checked per mode: the trainers get a `TransferFailed` that names the worker, its engine and the
version; the lost engine's other rank gets one from poll_requests(); the surviving engine runs
one version per step, bit-exact with its own load_weights at every install, and ends on the
last version sent (the next send_weights goes on with it).
"""

import threading
import time

import pytest
import torch
from moegroup import (CHECKPOINTS, CONFIG, ENGINE_TP, ENGINES, MODES, REFERENCE, SPEC,
                      TRAINER_TP)
from moegroup import group as adapters_group
from moegroup import same_bits

from meshes.qwen3_moe import RolloutShard, TrainerShard
from weightbridge import ReceiverAdapter, SenderAdapter, TransferConfig, TransferFailed
from weightbridge.coordination.local_control import LocalControl, WorkerGone
from weightbridge.types import Stage

VICTIM = 1  # rollout worker R1: engine 0, engine rank 1
LAST = 3


class DiesInSecondTransfer(ReceiverAdapter):
    """A rollout worker whose process dies at the third round of the second transfer."""

    forwards = 0

    def on_forward(self, r, stage):
        if stage is Stage.EXTERNAL:
            self.forwards += 1
            if self.forwards == self.executor.num_rounds + min(3, self.executor.num_rounds):
                self.control.kill(self.worker)
                self.on_fail("killed")  # its own threads end with the process
                raise WorkerGone(f"{self.worker} died")
        return super().on_forward(r, stage)


def _group(options):
    return adapters_group(options, receiver_cls=lambda rank: (
        DiesInSecondTransfer if rank == VICTIM else ReceiverAdapter))


def _connect(trainers):
    errors = []
    threads = [threading.Thread(target=lambda a=a: _catch(errors, a.connect))
               for _, a in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.slow
def test_a_rollout_killed_mid_transfer_fails_closed_and_the_survivors_go_on(mode):
    ss, rs = MODES[mode]
    options = TransferConfig(sender_staging=ss, receiver_staging=rs, round_bytes=96 << 10,
                             timeout_s=10)
    control, trainers, rollouts = _group(options)
    _connect(trainers)
    failures: dict[int, list[tuple[str, int, TransferFailed]]] = {i: [] for i in range(TRAINER_TP)}
    done = threading.Event()
    after_version = threading.Barrier(TRAINER_TP, timeout=60)

    def trainer(shard, adapter):
        i = adapter.worker.index
        for v in range(1, LAST + 1):
            with torch.no_grad():
                shard.load_weights(CHECKPOINTS[v].items())
            try:
                adapter.send_weights(v)
            except TransferFailed as e:
                failures[i].append(("send_weights", v, e))
            if i == 0 and ss:  # one transfer at a time: the second one is version 2
                try:
                    adapter.wait_idle()
                except TransferFailed as e:
                    failures[i].append(("wait_idle", v, e))
            after_version.wait()

    installs: dict[int, list[int]] = {}
    rollout_errors: dict[int, BaseException] = {}
    barriers = [threading.Barrier(ENGINE_TP, timeout=60) for _ in range(ENGINES)]
    seen: dict[tuple[int, int], set] = {}
    lock = threading.Lock()

    def rollout(shard, adapter):
        try:
            while not done.is_set():
                v = adapter.poll_requests()
                if v is not None:
                    assert same_bits(shard.params, REFERENCE[adapter.engine_rank][v]), \
                        f"{adapter.worker} not bit-exact at version {v}"
                    installs.setdefault(adapter.worker.index, []).append(v)
                with lock:
                    seen.setdefault((adapter.engine, adapter.step), set()).add(adapter.version)
                barriers[adapter.engine].wait()
                if adapter.engine == 1 and all(a.version == LAST for _, a in rollouts[2:]):
                    barriers[adapter.engine].wait()  # both ranks saw the last version
                    return
        except threading.BrokenBarrierError:
            # A rank of the engine died (its collectives break). Once trainer 0 has found the
            # loss, this rank's poll refuses to go on (RS: that may take a few polls).
            try:
                for _ in range(3000):
                    adapter.poll_requests()
                    time.sleep(0.01)
                rollout_errors[adapter.worker.index] = AssertionError("poll went on")
            except BaseException as e:  # noqa: BLE001
                rollout_errors[adapter.worker.index] = e
        except BaseException as e:  # noqa: BLE001
            rollout_errors[adapter.worker.index] = e
            barriers[adapter.engine].abort()

    threads = [threading.Thread(target=trainer, args=t) for t in trainers]
    threads += [threading.Thread(target=rollout, args=r) for r in rollouts]
    for t in threads:
        t.start()
    for t in threads[:TRAINER_TP]:
        t.join(timeout=120)
    for t in threads[TRAINER_TP:]:
        t.join(timeout=60)
    done.set()
    assert not any(t.is_alive() for t in threads), "a worker hung"

    # The trainers: one clear error, for version 2; every trainer in sync and RS modes.
    raised = [f for fs in failures.values() for f in fs]
    want_trainers = [0] if ss else list(range(TRAINER_TP))
    assert sorted(i for i, fs in failures.items() for _ in fs) == want_trainers, raised
    message = str(raised[0][2])
    assert "R1 (engine 0) failed during the transfer of version 2" in message, message
    assert "Engine [0] is excluded" in message and "add_engines()" in message, message
    assert ("re-sent to the surviving engines [1]" in message) is (not ss), message
    # The lost engine's other rank refuses to go on; the victim's own threads ended.
    assert isinstance(rollout_errors.pop(0), TransferFailed)
    assert isinstance(rollout_errors.pop(VICTIM), TransferFailed)
    assert not rollout_errors, rollout_errors
    # The surviving engine: one version per step, installs in order, on the last version.
    for (engine, step), versions in seen.items():
        if engine == 1:
            assert len(versions) == 1, (step, versions)
    for j in (2, 3):
        got = installs[j]
        assert got == sorted(set(got)) and got[-1] == LAST, got
        assert (2 in got) is (not ss), f"version 2 reaches the survivors iff re-sent: {got}"
        shard, a = rollouts[j]
        assert a.version == LAST and same_bits(shard.params, REFERENCE[a.engine_rank][LAST])
    assert trainers[0][1].failed_engines == {0}


def test_setup_probes_collective_loaders_at_once():
    """Trainers whose load_weights meet at a barrier (a stand-in for a collective load over
    the trainer ranks): probed one after the other they would wait on each other forever."""
    control = LocalControl()
    barrier = threading.Barrier(TRAINER_TP, timeout=20)
    calls = [0] * TRAINER_TP
    trainers = []
    config = TransferConfig(round_bytes=96 << 10, timeout_s=30)  # every worker's (connect checks)
    for i in range(TRAINER_TP):
        shard = TrainerShard(CONFIG, TRAINER_TP, i, 1, 0)

        def load(weights, load=shard.load_weights, i=i):
            calls[i] += 1
            barrier.wait()  # every rank loads together
            load(weights)

        trainers.append((shard, control.add(SenderAdapter(
            shard.params, load, SPEC, rank=i, control=control, transport=control.transport,
            config=config))))
    for j in range(ENGINE_TP):
        shard = RolloutShard(CONFIG, ENGINE_TP, j, 1, 0)
        control.add(ReceiverAdapter(shard.params, shard.load_weights, SPEC, rank=j, engine=0,
                                    engine_rank=j, engine_size=ENGINE_TP, control=control,
                                    transport=control.transport, config=config))
    # Probed alone, a rank waits at the barrier for a partner that never comes.
    alone = threading.Barrier(TRAINER_TP, timeout=0.5)
    barrier_saved, barrier = barrier, alone
    with pytest.raises(threading.BrokenBarrierError):
        trainers[0][1].on_source_map()
    barrier = barrier_saved
    calls[:] = [0] * TRAINER_TP
    _connect(trainers)
    assert all(a.executor is not None for _, a in trainers)
    assert calls[0] == calls[1] > 0


def test_a_failed_probe_reaches_every_trainer_at_once_not_at_timeout():
    """Trainer 0's connect fails (a rollout's load_weights raises): the other trainers' connect
    raise right away with the cause, instead of waiting timeout_s for a plan."""
    options = TransferConfig(timeout_s=60)
    control, trainers, rollouts = _group(options)

    def broken(weights):
        raise RuntimeError("engine loader crashed")

    rollouts[2][1].load_weights = broken
    errors = []
    threads = [threading.Thread(target=lambda a=a: _catch(errors, a.connect))
               for _, a in trainers]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - start < options.timeout_s / 2
    assert len(errors) == TRAINER_TP
    assert all("engine loader crashed" in str(e) for e in errors), errors
    assert any("trainer 0's connect failed" in str(e) for e in errors)


def test_a_probe_longer_than_timeout_s_does_not_time_out_the_other_trainers():
    """Probing grows with the model: trainer 1 waits for the plan past timeout_s while trainer
    0 is still probing, and both connects succeed. (No source map cache: a map kept by an
    earlier connect of the same workers would be verified in one load, not probed.)"""
    options = TransferConfig(timeout_s=0.5, source_map_cache=None)
    control, trainers, rollouts = _group(options)
    shard, adapter = rollouts[0]
    slow_calls = []

    def slow(weights):
        slow_calls.append(time.monotonic())
        time.sleep(0.4)  # three loads (two index passes, the verification) outlast 2 x timeout_s
        shard.load_weights(weights)

    adapter.load_weights = slow
    start = time.monotonic()
    _connect(trainers)
    assert time.monotonic() - start > 2 * options.timeout_s  # the probe outlasted timeout_s
    assert len(slow_calls) >= 3 and all(a.executor is not None for _, a in trainers)


def test_a_trainer_waits_at_most_timeout_s_when_trainer_0_never_connects():
    options = TransferConfig(timeout_s=0.5)
    control, trainers, rollouts = _group(options)
    with pytest.raises(TimeoutError, match="trainer 0 is not probing or planning"):
        trainers[1][1].connect()
